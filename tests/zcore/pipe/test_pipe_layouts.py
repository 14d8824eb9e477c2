"""Bad pipeline layouts fail at start, naming the numbers and the fix."""

from __future__ import annotations

import itertools

import pytest
from torch import nn

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.pipe.common import Block, config, loss_fn, make_pipe
from zcore.config import ZConfig
from zcore.config.errors import ConfigError
from zcore.pipe import LayerSpec, PipelineModule
from zcore.pipe.partition import balanced, partition
from zcore.pipe.schedules import check_layout


def test_partition_methods() -> None:
    assert balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced([10, 1, 1, 1, 1, 10], 2) == [0, 3, 6]
    names = ["Embedding", "Block", "Block", "Block", "Block", "LayerNorm", "Linear"]
    assert partition("uniform", names, [0] * 7, 2) == [0, 3, 7]
    assert partition("parameters", names, [100, 10, 10, 10, 10, 1, 100], 2) == [0, 3, 7]
    # a V layout balances ranks (stages 0+3 and 1+2), not stages
    v = partition("parameters", ["x"] * 8, [12, 40, 40, 40, 40, 40, 40, 12], 4, v_shape=True)
    assert v == [0, 2, 3, 5, 8]
    bounds = partition("type:block", names, [0] * 7, 2)
    assert [sum(n == "Block" for n in names[a:b]) for a, b in itertools.pairwise(bounds)] == [2, 2]


def test_fewer_layers_than_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"has 2 layers but 4 stages.*at least 4 layers"):
        PipelineModule([LayerSpec(Block), LayerSpec(Block)], num_stages=4)
    with pytest.raises(ValueError, match=r"matches 1 of the 3 layers.*2 stages"):
        PipelineModule(
            [LayerSpec(Block), LayerSpec(nn.ReLU), LayerSpec(nn.ReLU)],
            num_stages=2,
            partition_method="type:block",
        )


def test_world_not_a_multiple_of_the_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="world size 3 is not divisible by num_stages 2"):
        make_pipe(2)


def test_schedules_name_their_needs() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule 'dualpipe'; choose one of"):
        check_layout("dualpipe", 1, "loop", 2, 4)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps 2 < pp 4.*>= 4"):
        check_layout("1f1b", 1, "loop", 4, 2)
    with pytest.raises(ValueError, match="virtual_stages=2, stage_order='v'"):
        check_layout("zbv", 1, "loop", 2, 4)
    with pytest.raises(ValueError, match="runs one stage per rank"):
        check_layout("gpipe", 2, "loop", 2, 4)
    assert check_layout("gpipe", 1, "loop", 4, 1).name == "gpipe"


def test_pipeline_config_keys() -> None:
    with pytest.raises(ConfigError, match="schedule"):
        ZConfig.load(config(0, schedule="dualpipe"))
    with pytest.raises(ConfigError, match=r"pipeline.micro_batches"):
        ZConfig.load({**config(0), "pipeline": {"micro_batches": 4}})
    parsed = ZConfig.load(config(0, schedule="zbv")).extension("pipeline")
    assert parsed.schedule == "zbv" and parsed.stages == "auto"


def _refusals(rank: int, world: int) -> list[str]:
    live = {
        "stage": 3,
        "stage3_param_persistence_threshold": 100,
        "stage3_max_live_parameters": 1000,
    }
    cases = {
        "gas": (make_pipe(2), config(1, gas=1)),
        "zbv": (make_pipe(2), config(1, schedule="zbv")),
        "stages": (make_pipe(2), {**config(1), "pipeline": {"stages": 4}}),
        "live": (make_pipe(2), config(3, zero_optimization=live)),
    }
    out = []
    for _, (model, cfg) in cases.items():
        try:
            zcore.initialize(model, config=cfg)
        except ValueError as err:
            out.append(str(err))
        else:
            out.append("no error")
    return out


def test_bad_layouts_fail_at_start_on_every_rank() -> None:
    outs = run_ranks(_refusals, 2)
    assert outs[0][3] == outs[1][3]  # both stages name the larger one's parameters
    for msgs in outs:
        gas, zbv, stages, live = msgs
        assert "gradient_accumulation_steps 1 < pp 2" in gas
        assert "virtual_stages=2, stage_order='v'" in zbv
        assert "pipeline.stages 4 != the model's num_stages 2" in stages
        assert "stage3_max_live_parameters is 1000" in live, live
        assert "raise stage3_max_live_parameters to at least" in live


class _Experts(nn.Linear):
    """A layer asking the mesh for expert parallelism, as zmoe's MoE layer does."""

    def mesh_axes(self) -> dict[str, int]:
        return {"ep": 2}


def test_expert_parallelism_inside_stages_is_refused_naming_why() -> None:
    model = PipelineModule([_Experts(4, 4)], num_stages=1, loss_fn=loss_fn)
    with pytest.raises(ValueError, match=r"ep_size 2\) inside pipeline stages is not built"):
        zcore.initialize(model, config=config(1))


def test_a_pipeline_built_inside_zero_init_is_refused() -> None:
    """zero.Init would broadcast each layer over every rank while the stages build
    different layers; the refusal says to build it outside (stage 3 still cuts it)."""
    with zcore.zero.Init(config=config(3)):
        with pytest.raises(ValueError, match=r"num_stages=2\) inside zcore.zero.Init"):
            make_pipe(2)
