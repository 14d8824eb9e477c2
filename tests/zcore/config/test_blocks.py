"""Config blocks other packages own: registered in-process or found through installed entry
points, validated by their schema (did-you-mean inside), handed over by `ZConfig.extension`."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.zcore.config.common import load_error
from tests.zcore.plugin_package import write_zplug
from zcore.config import (
    ZConfig,
    blocks,
    optim_registry,
    register_config_block,
    registered_config_blocks,
    unregister_config_block,
)


class Sparsity(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    dense_ratio: float = Field(0.5, gt=0, le=1)


def parse_tags(value: Any) -> tuple[str, ...]:
    """A schema for a package without pydantic: a function that raises ValueError."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"tags: expected a list of strings, got {value!r}")
    return tuple(value)


@pytest.fixture(autouse=True)
def registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test registers into copies of the registries."""
    monkeypatch.setattr(blocks, "_schemas", dict(blocks._schemas))
    monkeypatch.setattr(optim_registry, "_specs", dict(optim_registry._specs))


def test_a_registered_block_is_validated_and_handed_over() -> None:
    register_config_block("sparsity", Sparsity)
    cfg = ZConfig.load({"sparsity": {"enabled": True}})
    assert cfg.extension("sparsity") == Sparsity(enabled=True, dense_ratio=0.5)
    assert cfg.to_dict()["sparsity"] == {"enabled": True, "dense_ratio": 0.5}
    assert ZConfig.load(cfg.to_dict()) == cfg
    assert ZConfig.load({}).extension("sparsity") is None


def test_typo_in_a_registered_block_gets_did_you_mean() -> None:
    register_config_block("sparsity", Sparsity)
    error = load_error({"sparsity": {"dense_ration": 0.2}})
    (problem,) = error.problems
    assert problem.message == "unknown key sparsity.dense_ration; did you mean dense_ratio?"


def test_values_in_a_registered_block_name_the_key() -> None:
    register_config_block("sparsity", Sparsity)
    error = load_error({"sparsity": {"dense_ratio": 2}, "steps_per_print": 0})
    assert [p.path for p in error.problems] == ["steps_per_print", "sparsity.dense_ratio"]
    assert error.problems[1].message == "sparsity.dense_ratio = 2: must be <= 1.0 (default 0.5)"


def test_a_function_schema_reports_its_value_error() -> None:
    register_config_block("tags", parse_tags)
    assert ZConfig.load({"tags": ["a", "b"]}).extension("tags") == ("a", "b")
    (problem,) = load_error({"tags": "a"}).problems
    assert (problem.path, problem.message) == ("tags", "tags: expected a list of strings, got 'a'")


def test_top_level_typo_suggests_registered_blocks() -> None:
    register_config_block("sparsity", Sparsity)
    (problem,) = load_error({"sparsty": {}}).problems
    assert problem.message == "unknown key sparsty; did you mean sparsity?"
    unregister_config_block("sparsity")
    assert "sparsity" not in registered_config_blocks()


def test_registration_is_checked() -> None:
    with pytest.raises(TypeError, match="pydantic model class or a function"):
        register_config_block("x", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="identifier"):
        register_config_block("a.b", Sparsity)
    register_config_block("x", Sparsity)
    with pytest.raises(ValueError, match="already registered"):
        register_config_block("x", parse_tags)
    register_config_block("x", parse_tags, replace=True)


def test_entry_points_of_a_package_on_sys_path_are_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(write_zplug(tmp_path)))
    monkeypatch.delitem(sys.modules, "zplug", raising=False)
    assert "zplug" in registered_config_blocks()
    cfg = ZConfig.load(
        {"optimizer": {"type": "plainsgd", "params": {"lr": 0.1}}, "zplug": {"tag": "t"}}
    )
    assert cfg.optimizer is not None and cfg.optimizer.type == "PlainSGD"
    assert type(cfg.extension("zplug")).__module__ == "zplug"
    (problem,) = load_error({"zplug": {"tag": "t", "warmup_step": 3}}).problems
    assert problem.message == "unknown key zplug.warmup_step; did you mean warmup_steps?"


def test_an_entry_point_that_fails_to_load_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = tmp_path / "broken-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[zcore.config_blocks]\nbroken = no_such_module:X\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (problem,) = load_error({"broken": {}}).problems
    assert problem.path == "broken"
    assert "entry point `broken = no_such_module:X` of group zcore.config_blocks" in problem.message
    assert "ModuleNotFoundError" in problem.message


# -- zquant's compression_training, through zquant's own entry point --------------------------
# (that zquant imports no zcore is tests/test_layout.py's import table: zquant may not name it)


def _ds_config() -> dict[str, Any]:
    from tests.zquant.test_compression import DS_CONFIG

    return {**copy.deepcopy(DS_CONFIG), "zero_optimization": {"stage": 2}}


def test_zquant_compression_block_is_accepted_next_to_zero() -> None:
    from zquant.compression import CompressionConfig

    cfg = ZConfig.load(_ds_config())
    block = cfg.extension("compression_training")
    assert isinstance(block, CompressionConfig)
    assert block.sparse_pruning.shared_parameters.schedule_offset == 10
    assert cfg.zero_optimization.stage == 2
    assert ZConfig.load(cfg.to_dict()) == cfg


def test_zquant_compression_typo_is_reported_with_its_key() -> None:
    config = _ds_config()
    config["compression_training"]["row_pruning"]["shared_parameter"] = {}
    (problem,) = load_error(config).problems
    assert problem.path == "compression_training"
    assert problem.message.startswith(
        "compression_training.row_pruning: unknown key 'shared_parameter'"
    )
    assert problem.message.endswith("did you mean 'shared_parameters'?")
