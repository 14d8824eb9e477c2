"""Valid DeepSpeed configs load with DeepSpeed's defaults and normalized spellings; files,
JSON errors and the to_dict round trip."""

from __future__ import annotations

import json
import pickle

import pytest

import zcore.config
from tests.zcore.config.common import STAGE3, load_error
from zcore.config import AdamParams, ConfigError, WarmupDecayLRConfig, ZConfig
from zcore.config._base import ZModel


def test_realistic_stage3_config_loads() -> None:
    cfg = ZConfig.load(STAGE3)
    zero = cfg.zero_optimization
    assert zero.stage == 3
    assert zero.reduce_bucket_size == 500_000_000 and isinstance(zero.reduce_bucket_size, int)
    assert zero.stage3_prefetch_bucket_size == 450_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert zero.offload_optimizer is not None and zero.offload_optimizer.pin_memory is True
    assert zero.offload_param_device == "none"
    assert cfg.precision == "bf16"
    assert cfg.optimizer is not None and isinstance(cfg.optimizer.params, AdamParams)
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.decoupled_weight_decay
    assert isinstance(cfg.scheduler, WarmupDecayLRConfig)
    assert cfg.scheduler.params.total_num_steps == 10000
    assert cfg.tensorboard.enabled and cfg.tensorboard.job_name == "llama-7b"
    assert cfg.batch_sizes(8).train_batch_size == 64


def test_empty_config_has_deepspeed_defaults() -> None:
    cfg = ZConfig.load({})
    assert cfg.gradient_clipping == 0.0
    assert cfg.steps_per_print == 10
    assert cfg.gradient_predivide_factor == 1.0
    assert cfg.comm_timeout_s == 1800.0
    assert cfg.precision == "fp32"
    assert cfg.optimizer is None and cfg.scheduler is None
    zero = cfg.zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.allgather_bucket_size) == (0, 5e8, 5e8)
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (5e7, 1e5)
    assert zero.sub_group_size == 1e9
    assert cfg.fp16.initial_scale_power == 16 and cfg.fp16.dynamic_loss_scale
    assert cfg.csv_monitor.job_name == "DeepSpeedJobName"


@pytest.mark.parametrize(
    ("stage", "given", "expected"),
    [(2, None, False), (3, None, True), (3, False, False), (1, True, True)],
)
def test_overlap_comm_resolves_like_deepspeed(
    stage: int, given: bool | None, expected: bool
) -> None:
    zero: dict[str, object] = {"stage": stage}
    if given is not None:
        zero["overlap_comm"] = given
    cfg = ZConfig.load({"zero_optimization": zero})
    assert cfg.zero_optimization.overlap_comm is given
    assert cfg.zero_optimization.effective_overlap_comm is expected


def test_to_dict_round_trips_and_is_json() -> None:
    cfg = ZConfig.load(STAGE3)
    data = cfg.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["zero_optimization"]["stage"] == 3
    assert data["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert "flops_profiler" not in data  # a disabled, unbuilt feature is dropped
    assert ZConfig.load(data) == cfg


def test_config_is_immutable() -> None:
    cfg = ZConfig.load(STAGE3)
    with pytest.raises(ValueError, match="frozen"):
        cfg.zero_optimization.stage = 1  # type: ignore[misc]
    assert cfg.model_copy(update={"seed": 7}).seed == 7


def test_load_from_file_and_from_text(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(STAGE3, indent=2))
    assert ZConfig.load(path) == ZConfig.load(str(path)) == ZConfig.load(STAGE3)
    assert ZConfig.load(json.dumps(STAGE3)) == ZConfig.load(STAGE3)


def test_missing_file_names_the_path(tmp_path) -> None:
    missing = tmp_path / "nope" / "ds_config.json"
    error = load_error(missing)
    assert str(missing) in str(error) and "does not exist" in str(error)


def test_bad_json_names_line_and_column(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    message = str(load_error(path))
    assert str(path) in message and "line 3, column 28" in message


def test_duplicate_json_key_is_an_error(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert "`train_batch_size` appears twice" in str(load_error(path))


def test_value_errors_in_a_file_name_the_file(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 0}')
    error = load_error(path)
    assert error.source == str(path)
    assert str(error) == f"{path}: train_batch_size = 0: must be >= 1"


def test_top_level_must_be_an_object(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text("[1, 2]")
    assert "must be a JSON object, got list" in str(load_error(path))


def test_wrong_source_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="dict or a JSON file path"):
        ZConfig.load(42)  # type: ignore[arg-type]


def test_config_error_is_a_value_error_and_pickles() -> None:
    error = load_error({"steps_per_print": 0, "seed": -1})
    assert isinstance(error, ValueError)
    again = pickle.loads(pickle.dumps(error))
    assert isinstance(again, ConfigError)
    assert str(again) == str(error) and again.problems == error.problems


def test_every_field_has_a_docstring() -> None:
    models = [
        m for m in vars(zcore.config).values() if isinstance(m, type) and issubclass(m, ZModel)
    ]
    assert len(models) > 20
    undocumented = [
        f"{m.__name__}.{name}"
        for m in models
        for name, field in m.model_fields.items()
        if not field.description
    ]
    assert not undocumented
