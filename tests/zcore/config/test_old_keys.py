"""Keys earlier DeepSpeed releases documented are read under their current name with an
OldKeyWarning that names the key to write; each entry of the table is checked here."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from tests.zcore.config.common import load_error
from zcore.config import OldKeyWarning, ZConfig, ZeroConfig, features


@pytest.fixture(autouse=True)
def offload_unlocked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offload blocks the old keys turn into load as they do with zoffload installed."""
    monkeypatch.setattr(
        features,
        "_registered",
        {"zero_optimization.offload_optimizer", "zero_optimization.offload_param", "aio"},
    )


def load_warning(config: dict[str, Any]) -> tuple[ZConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = ZConfig.load(config)
    assert all(w.category is OldKeyWarning for w in caught)
    return cfg, [str(w.message) for w in caught]


def test_bfloat16_is_bf16() -> None:
    cfg, (message,) = load_warning({"bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled and cfg.precision == "bf16"
    assert message.startswith("`bfloat16` is an old DeepSpeed key (runtime/constants.py")
    assert message.endswith("read as `bf16`; write that instead")
    assert "bfloat16" not in cfg.to_dict()


def test_gather_fp16_weights_is_the_16bit_key() -> None:
    zero = {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}
    cfg, (message,) = load_warning({"zero_optimization": zero})
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    assert "read as `zero_optimization.stage3_gather_16bit_weights_on_model_save`" in message


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("cpu_offload", "offload_optimizer"),
        ("cpu_offload_param", "offload_param"),
        ("cpu_offload_params", "offload_param"),
    ],
)
def test_cpu_offload_flags_become_offload_blocks(old: str, new: str) -> None:
    cfg, (message,) = load_warning({"zero_optimization": {"stage": 3, old: True}})
    block = getattr(cfg.zero_optimization, new)
    assert block is not None and block.device == "cpu" and block.pin_memory is False
    assert message.startswith(f"`zero_optimization.{old}` is an old DeepSpeed key (")
    assert message.endswith(
        f'read as `zero_optimization.{new}` = {{"device": "cpu"}}; write that instead'
    )
    off, (message,) = load_warning({"zero_optimization": {"stage": 3, old: False}})
    assert getattr(off.zero_optimization, new) is None
    assert f"it sets nothing; remove it (the setting is `zero_optimization.{new}`)" in message


def test_cpu_offload_use_pin_memory_is_read_and_not_applied() -> None:
    zero = {"stage": 3, "cpu_offload": True, "cpu_offload_use_pin_memory": True}
    cfg, messages = load_warning({"zero_optimization": zero})
    assert cfg.zero_optimization.offload_optimizer is not None
    assert cfg.zero_optimization.offload_optimizer.pin_memory is False  # as DeepSpeed
    assert len(messages) == 2
    assert messages[1].startswith("`zero_optimization.cpu_offload_use_pin_memory` = true is an")
    assert "it sets nothing, as in DeepSpeed; pinning is `pin_memory` in" in messages[1]


def test_aio_thread_count_is_intra_op_parallelism() -> None:
    cfg, (message,) = load_warning({"aio": {"thread_count": 4}})
    assert cfg.aio is not None and cfg.aio.intra_op_parallelism == 4
    assert "read as `aio.intra_op_parallelism`" in message


def test_old_key_next_to_its_current_one_is_an_error() -> None:
    error = load_error({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}})
    assert "`bfloat16` is DeepSpeed's old name for `bf16`, which is also given" in str(error)
    assert "keep only `bf16`" in str(error)
    zero = {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}
    (problem,) = load_error({"zero_optimization": zero}).problems
    assert problem.path == "zero_optimization.cpu_offload"


def test_old_flag_with_a_wrong_value_names_it() -> None:
    (problem,) = load_error({"zero_optimization": {"stage": 2, "cpu_offload": "yes"}}).problems
    assert problem.message == 'zero_optimization.cpu_offload = "yes": must be true or false'


def test_old_keys_are_never_suggested() -> None:
    (problem,) = load_error({"zero_optimization": {"cpu_offlaod": True}}).problems
    assert "cpu_offload" not in problem.message.split("valid keys here: ", 1)[1]


def test_a_block_validated_on_its_own_renames_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero = ZeroConfig.model_validate({"stage": 1, "cpu_offload": True})
    assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
