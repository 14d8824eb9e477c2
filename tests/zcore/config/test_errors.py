"""Each kind of bad config fails with a message naming the key path, the value and the fix;
several problems are reported together, one per line."""

from __future__ import annotations

import pytest

from tests.zcore.config.common import load_error, stage3
from zcore.config import ConfigError, OldKeyWarning, ZConfig


def only_line(config: dict) -> str:
    error = load_error(config)
    assert len(error.problems) == 1, str(error)
    return str(error)


def test_unknown_top_level_key_suggests_the_close_one() -> None:
    error = load_error(stage3(trian_batch_size=8))
    assert "unknown key trian_batch_size; did you mean train_batch_size?" in str(error)
    assert error.problems[0].path == "trian_batch_size"


def test_unknown_nested_key_names_the_full_path() -> None:
    config = stage3()
    config["zero_optimization"]["reduce_bucket_sizes"] = 1
    assert only_line(config) == (
        "unknown key zero_optimization.reduce_bucket_sizes; did you mean reduce_bucket_size?"
    )


def test_unknown_key_without_a_close_match_lists_the_valid_keys() -> None:
    message = only_line({"fp16": {"enabled": True, "banana": 1}})
    assert message.startswith("unknown key fp16.banana; valid keys here: ")
    assert "initial_scale_power" in message and "loss_scale_window" in message


@pytest.mark.parametrize("stage", [4, -1, 2.5])
def test_stage_out_of_range(stage: float) -> None:
    message = only_line({"zero_optimization": {"stage": stage}})
    assert message == f"zero_optimization.stage = {stage}: stage must be 0, 1, 2 or 3"


@pytest.mark.parametrize("size", [-1, 0])
def test_non_positive_bucket_size_names_key_value_and_default(size: int) -> None:
    message = only_line({"zero_optimization": {"reduce_bucket_size": size}})
    assert message == (
        f"zero_optimization.reduce_bucket_size = {size}: must be > 0 (default 500000000)"
    )


def test_fractional_bucket_size_is_rejected() -> None:
    message = only_line({"zero_optimization": {"allgather_bucket_size": 2.5e8 + 0.5}})
    assert message.startswith("zero_optimization.allgather_bucket_size = ")
    assert message.endswith("must be a whole number")


def test_fp16_and_bf16_together() -> None:
    with pytest.warns(OldKeyWarning, match="`bfloat16` is an old DeepSpeed key"):
        message = only_line({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert message.startswith("bf16.enabled = true: fp16.enabled and bf16.enabled are both true")


def test_bad_optimizer_type_suggests_one() -> None:
    message = only_line({"optimizer": {"type": "Adamm", "params": {}}})
    assert message.startswith(
        'optimizer.type = "Adamm": not a registered optimizer type; did you mean Adam?'
    )
    registered = message.split("(registered: ", 1)[1].split(";", 1)[0].split(", ")
    assert {"Adagrad", "Adam", "AdamW", "Lion", "SGD"} <= set(registered)  # + installed plug-ins


def test_missing_optimizer_type() -> None:
    assert only_line({"optimizer": {"params": {"lr": 1}}}).startswith("optimizer.type: is required")


def test_unknown_optimizer_param() -> None:
    config = stage3()
    config["optimizer"]["params"]["fused"] = True
    assert only_line(config).startswith("unknown key optimizer.params.fused; valid keys here: ")


def test_optimizer_param_typo_suggests_one() -> None:
    message = only_line({"optimizer": {"type": "SGD", "params": {"momentun": 0.9}}})
    assert message == "unknown key optimizer.params.momentun; did you mean momentum?"


def test_amsgrad_is_not_supported() -> None:
    message = only_line({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}})
    assert message.startswith("optimizer.params.amsgrad = true: amsgrad is not supported")


@pytest.mark.parametrize(
    ("betas", "expected"),
    [
        ([0.9, 1.0], "optimizer.params.betas[1] = 1.0: must be < 1.0"),
        ([0.9], "optimizer.params.betas: too few items: item [1] is missing"),
        (
            [0.9, 0.99, 0.999],
            "optimizer.params.betas = [0.9, 0.99, 0.999]: must have 2 items, got 3",
        ),
    ],
)
def test_bad_betas(betas: list[float], expected: str) -> None:
    assert only_line({"optimizer": {"type": "AdamW", "params": {"betas": betas}}}) == expected


def test_nesterov_needs_momentum() -> None:
    message = only_line({"optimizer": {"type": "sgd", "params": {"nesterov": True}}})
    assert message.startswith("optimizer.params.nesterov = true: Nesterov momentum needs momentum")


def test_scheduler_missing_required_param_is_named() -> None:
    message = only_line({"scheduler": {"type": "WarmupCosineLR"}})
    assert message.startswith("scheduler.params.total_num_steps: is required")


@pytest.mark.parametrize(
    ("type_", "params"),
    [
        ("WarmupLR", {}),
        ("WarmupDecayLR", {"total_num_steps": 100}),
        ("WarmupCosineLR", {"total_num_steps": 100}),
    ],
)
def test_scheduler_warmup_num_steps_zero_is_refused(type_: str, params: dict) -> None:
    # DeepSpeed's schedules raise for it; zstack refuses it when the config loads.
    config = {"scheduler": {"type": type_, "params": {**params, "warmup_num_steps": 0}}}
    message = only_line(config)
    assert message.startswith("scheduler.params.warmup_num_steps = 0: must be >= 1"), message


def test_scheduler_bad_warmup_type_lists_choices() -> None:
    config = {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}
    assert only_line(config) == (
        'scheduler.params.warmup_type = "cosine": must be one of "log" or "linear"'
    )


def test_wrong_types_are_named() -> None:
    error = load_error(
        {"steps_per_print": True, "seed": "7", "wall_clock_breakdown": 1, "zero_optimization": 3}
    )
    lines = set(str(error).splitlines()[1:])
    assert lines == {
        "  steps_per_print = true: must be an integer",
        '  seed = "7": must be an integer',
        "  wall_clock_breakdown = 1: must be true or false",
        "  zero_optimization = 3: must be a block of keys (a JSON object)",
    }


def test_auto_from_hugging_face_gets_a_hint() -> None:
    message = only_line({"train_micro_batch_size_per_gpu": "auto"})
    assert '"auto" is filled in by the Hugging Face Trainer' in message


def test_non_finite_numbers_are_rejected() -> None:
    assert only_line({"gradient_clipping": float("inf")}).endswith("must be a finite number")


def test_every_problem_is_reported_one_per_line() -> None:
    config = stage3(trian_batch_size=8, steps_per_print=0)
    config["zero_optimization"]["stage"] = 4
    config["zero_optimization"]["reduce_bucket_size"] = -1
    config["optimizer"]["type"] = "Adamm"
    config["fp16"]["hysteresis"] = 0
    error = load_error(config)
    lines = str(error).splitlines()
    assert lines[0] == "6 problems in the config:"
    assert {p.path for p in error.problems} == {
        "trian_batch_size",
        "steps_per_print",
        "zero_optimization.stage",
        "zero_optimization.reduce_bucket_size",
        "optimizer.type",
        "fp16.hysteresis",
    }
    assert lines[1:] == [f"  {p.message}" for p in error.problems]


def test_problem_values_are_kept_for_programs() -> None:
    error = load_error({"zero_optimization": {"reduce_bucket_size": -5}})
    (problem,) = error.problems
    assert (problem.path, problem.value) == ("zero_optimization.reduce_bucket_size", -5)


def test_pydantic_errors_never_leak() -> None:
    with pytest.raises(ConfigError) as info:
        ZConfig.load({"optimizer": {"type": "Lion", "params": {"lr": "fast"}}})
    assert type(info.value) is ConfigError
    assert "pydantic" not in str(info.value) and "Input should" not in str(info.value)
