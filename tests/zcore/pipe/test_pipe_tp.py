"""Pipeline x tensor (x data) parallelism: ``z train``'s GPT cut into pipeline stages whose
layers are cut over ``tp``, against one process training the plain GPT.

The pipelined GPT (``ztrain.gpt_pipe``) starts from the plain GPT's weights; each step's
global batch is the same rows, the pipeline taking ``gradient_accumulation_steps``
micro-batches per data rank and the baseline all of them in one micro-batch, so the mean
losses are equal. Clipping is on (0.05, below every step's norm), so the gradient norm, each
element counted once across ``pp``, ``tp`` and ``dp`` and the tied embedding once across its
two stages, scales every update. Tolerances are tests/zcore/tensor/common.py's (fp32: losses
1e-5 relative, norms 1e-4 relative, every parameter element 2e-5 absolute after 10 steps).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.tensor.common import GPT_SHAPE, assert_same_run, global_batch, make_gpt, train
from tests.zcore.zero.common import config
from zcore.comm import MeshSpec
from zcore.pipe import TENSOR_PLAN, LayerSpec, PipelineModule
from zcore.tensor import gather_full_state_dict, parallelize
from zcore.tensor.vocab import VocabParallelLoss
from ztrain.gpt import GPTConfig
from ztrain.gpt_pipe import build_pipe_gpt, gpt_name

STEPS, MB, GAS = 10, 2, 2


def _run(rank: int, world: int, pp: int, tp: int, stage: int, kw: dict[str, Any]) -> dict:
    tie = kw.get("tie", True)
    schedule = kw.get("schedule", "1f1b")
    shape = GPTConfig(**GPT_SHAPE, tie_weights=tie)
    model = build_pipe_gpt(shape, pp, seed=0, schedule=schedule, **kw.get("pipe", {}))
    extra = {"pipeline": {"schedule": schedule}, "tensor_parallel": {"autotp_size": tp}}
    extra.update(kw.get("config", {}))
    cfg = config(stage, mb=MB, gas=GAS, clip=kw.get("clip", 0.05), **extra)
    engine, *_ = zcore.initialize(model, config=cfg)
    dp, d = engine.world_size, engine.data_rank
    losses, norms, scales = [], [], []
    for step in range(kw.get("steps", STEPS)):
        x, y = global_batch(step, MB * GAS * dp)
        rows = range(d * MB * GAS, (d + 1) * MB * GAS, MB)
        micro = [(x[r : r + MB], y[r : r + MB]) for r in rows]
        losses.append(float(engine.train_batch(iter(micro))))
        norms.append(engine.get_global_grad_norm())
        scales.append(engine.loss_scale)
    full = gather_full_state_dict(engine.module)
    params = {gpt_name(k, shape.n_layer): v for k, v in full.items()}
    engine.destroy()
    return {"losses": losses, "norms": norms, "params": params, "scales": scales}


def _baseline(dp: int, tie: bool = True, steps: int = STEPS) -> dict:
    (ref,) = run_ranks(_base, 1, args=(dp, tie, steps))
    return ref


def _base(rank: int, world: int, dp: int, tie: bool, steps: int) -> dict:
    return train(make_gpt(tie), None, 0, steps, mb=MB * GAS * dp, dp=1)


def _check(outs: list[dict], ref: dict) -> None:
    merged: dict[str, torch.Tensor] = {}
    for rank, out in enumerate(outs):
        assert_same_run({**out, "params": ref["params"]}, ref, f"rank {rank}")
        merged.update(out["params"])
    if "lm_head.weight" in ref["params"] and "lm_head.weight" not in merged:
        merged["lm_head.weight"] = merged["transformer.wte.weight"]  # the tie's other name
    assert_same_run({**outs[0], "params": merged}, ref, "gathered parameters")


@pytest.mark.slow(
    reason="4 ranks, 25-35 s here; test_pp2_clipping_counts_the_tie_once runs by default"
)
def test_pp2_tp2_matches_single_process() -> None:
    """4 ranks: two stages, each cut over two tp ranks, ZeRO-1, tied embedding."""
    _check(run_ranks(_run, 4, args=(2, 2, 1, {}), timeout=180), _baseline(1))


def test_pp2_clipping_counts_the_tie_once() -> None:
    """2 ranks, tp 1: the tied embedding's two copies count once in the clipped norm."""
    _check(run_ranks(_run, 2, args=(2, 1, 1, {}), timeout=120), _baseline(1))


@pytest.mark.slow(reason="4 ranks; the tie's norm share at ZeRO-2 averaged over dp")
def test_pp2_dp2_zero2_clipping_counts_the_tie_once() -> None:
    _check(run_ranks(_run, 4, args=(2, 1, 2, {}), timeout=240), _baseline(2))


@pytest.mark.slow(reason="4 ranks; ZeRO-3 gathers each stage's cut and whole parameters once")
def test_pp2_dp2_zero3_clipping_counts_the_tie_once() -> None:
    _check(run_ranks(_run, 4, args=(2, 1, 3, {}), timeout=240), _baseline(2))


@pytest.mark.slow(reason="4 ranks; tp-cut shards gathered over dp 1 for the step")
def test_pp2_tp2_zero3_matches_single_process() -> None:
    _check(run_ranks(_run, 4, args=(2, 2, 3, {}), timeout=240), _baseline(1))


@pytest.mark.slow(reason="8 ranks x 3 ZeRO stages; test_pp2_tp2 covers pp x tp on 4")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_pp2_tp2_dp2_zero_stages(stage: int) -> None:
    _check(run_ranks(_run, 8, args=(2, 2, stage, {}), timeout=400), _baseline(2))


@pytest.mark.slow(reason="4 ranks per schedule; 1f1b runs by default")
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b", "zbv"])
def test_pp2_tp2_schedules(schedule: str) -> None:
    kw = {"schedule": schedule}
    _check(run_ranks(_run, 4, args=(2, 2, 0, kw), timeout=240), _baseline(1))


@pytest.mark.slow(reason="4 ranks")
def test_pp2_tp2_zbv_with_activation_checkpointing() -> None:
    """ZB-V, ZeRO-2, every layer checkpointed: the recomputation runs each block's tp
    collectives again, in the same order on every tp rank (fp32, the usual tolerances)."""
    kw = {"schedule": "zbv", "pipe": {"activation_checkpoint_interval": 1}}
    _check(run_ranks(_run, 4, args=(2, 2, 2, kw), timeout=240), _baseline(1))


@pytest.mark.slow(reason="4 ranks")
def test_pp2_tp2_fp16_loss_scale_agreed() -> None:
    """fp16 from a loss scale that overflows: every rank skips the same steps (the overflow
    flag is taken over dp, tp and pp) and holds the same loss scale after each step."""
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 2}}
    outs = run_ranks(_run, 4, args=(2, 2, 1, {"config": fp16}), timeout=240)
    for out in outs:
        assert out["scales"] == outs[0]["scales"]
        assert out["losses"] == outs[0]["losses"]
    scales = outs[0]["scales"]
    assert min(scales) < 2.0**24, scales  # some steps overflowed and were skipped
    assert outs[0]["losses"][-1] < outs[0]["losses"][0]


@pytest.mark.slow(reason="4 ranks")
def test_pp2_tp2_bf16_tracks_fp32() -> None:
    """bf16 activations cross the stages and the tp collectives; losses within 1% of the
    fp32 single process's, the same on every rank."""
    bf16 = {"bf16": {"enabled": True}}
    outs = run_ranks(_run, 4, args=(2, 2, 1, {"config": bf16}), timeout=240)
    ref = _baseline(1)
    for out in outs:
        assert out["losses"] == outs[0]["losses"]
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-2)


def test_pipe_plan_names_every_problem() -> None:
    """The ``pipe`` plan checks every layer (built on ``meta``) before any is cut."""
    model = build_pipe_gpt(GPTConfig(**GPT_SHAPE), 1)
    problems = TENSOR_PLAN.problems(model, 5)
    text = "\n".join(problems)
    assert "n_head 4 is not divisible by tp 5" in text
    assert f"vocab_size {GPT_SHAPE['vocab_size']} is not divisible by tp 5" in text
    assert len(problems) == 2, problems  # one line per problem, not one per block


def test_sequence_parallelism_inside_stages_is_refused() -> None:
    model = build_pipe_gpt(GPTConfig(**GPT_SHAPE), 1)
    with pytest.raises(ValueError, match="sequence parallelism inside pipeline stages"):
        parallelize(model, MeshSpec.resolve(1), sequence_parallel=True)


def _uncut_stage(rank: int, world: int) -> str:
    """Stage 0 holds the cut embedding; stage 1 only layers without ``tp_cut``."""
    from ztrain.gpt_pipe import TokenEmbedding

    shape = GPTConfig(**GPT_SHAPE)
    layers = [LayerSpec(TokenEmbedding, shape.vocab_size, shape.n_embd)]
    layers += [LayerSpec(nn.LayerNorm, shape.n_embd), LayerSpec(nn.Linear, shape.n_embd, 8)]
    model = PipelineModule(
        layers, num_stages=2, loss_fn=VocabParallelLoss(), partition_method="uniform"
    )
    extra = {"pipeline": {"schedule": "gpipe"}, "tensor_parallel": {"autotp_size": 2}}
    try:
        zcore.initialize(model, config=config(1, mb=MB, gas=GAS, **extra))
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.slow(reason="4 ranks")
def test_a_stage_without_cut_layers_is_refused_on_every_rank() -> None:
    """The norm's collectives run per group axis over pp: a stage without tp-cut layers
    beside stages with them would leave the others waiting; every rank raises instead."""
    for msg in run_ranks(_uncut_stage, 4, timeout=120):
        assert "tp-axis parameters but another of the 2 stages differs" in msg, msg
