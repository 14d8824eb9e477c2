"""Unbuilt DeepSpeed features are rejected with the package that will own them, disabled
blocks pass, and `register_feature` unlocks a key."""

from __future__ import annotations

import pytest

from tests.zcore.config.common import STAGE3, load_error, stage3
from zcore.config import (
    ZConfig,
    blocks,
    features,
    plugins,
    register_feature,
    registered_features,
    unregister_feature,
)
from zcore.config.features import GATED

_NOT_INSTALLED = (
    "offload is provided by the zoffload package, which is not installed: "
    '`pip install zoffload`, or set device to "none" or remove the block'
)
OFFLOAD_MESSAGE = {"offload_optimizer": _NOT_INSTALLED, "offload_param": _NOT_INSTALLED}


@pytest.fixture(autouse=True)
def empty_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with nothing registered (as zcore alone is) and leaves the session's
    registry as it found it, whatever other packages registered at import."""
    monkeypatch.setattr(features, "_registered", set())
    monkeypatch.setattr(features, "_loaded", True)  # installed extensions stay unloaded
    # nor do installed packages' config blocks (zquant's compression_training) count
    monkeypatch.setattr(blocks, "_schemas", {})
    monkeypatch.setattr(plugins, "discover", lambda group: {})


def nested(path: str, value: object) -> dict:
    """``{"a": {"b": value}}`` for path ``a.b``."""
    *parents, last = path.split(".")
    config: dict = {last: value}
    for key in reversed(parents):
        config = {key: config}
    return config


ON_VALUES = {
    "zero_optimization.zero_quantized_weights": True,
    "zero_optimization.zero_quantized_gradients": True,
    "zero_optimization.round_robin_gradients": True,
    "zero_optimization.zero_hpz_partition_size": 8,
    "aio": {"block_size": 1048576},  # a valid block: only the gate objects
}
OWNERS = {
    "zero_optimization.zero_quantized_weights": "zcomm",
    "zero_optimization.zero_quantized_gradients": "zcomm",
    "zero_optimization.zero_hpz_partition_size": "zcomm",
    "aio": "zoffload",
    "compression_training": "zquant",
    "moe": "zmoe",
}
BLOCKS = sorted(k for k in GATED if ".offload_" not in k)


def test_register_and_unregister() -> None:
    assert registered_features() == frozenset()
    register_feature("aio")
    register_feature("aio")
    assert registered_features() == {"aio"}
    unregister_feature("aio")
    unregister_feature("never-registered")
    assert registered_features() == frozenset()


@pytest.mark.parametrize("key", BLOCKS)
def test_unbuilt_feature_is_rejected_naming_its_owner(key: str) -> None:
    value = ON_VALUES.get(key, {"enabled": True})
    error = load_error(nested(key, value))
    (problem,) = error.problems
    assert problem.path == key
    assert problem.message.startswith(f"`{key}` is a DeepSpeed feature zstack does not build yet (")
    owner = OWNERS.get(key)
    expected = f"it will come with the {owner} package" if owner else "no zstack package plans it"
    assert expected in problem.message
    assert "remove it from the config" in problem.message


@pytest.mark.parametrize(
    "config",
    [
        {"wandb": {"enabled": False}},
        {"flops_profiler": {"enabled": False, "profile_step": 1}},
        {"moe": None},
        {"zero_optimization": {"zero_quantized_weights": False, "zero_hpz_partition_size": 1}},
        {"zero_optimization": {"round_robin_gradients": False}},
    ],
)
def test_features_left_off_are_accepted(config: dict) -> None:
    ZConfig.load(config)


@pytest.mark.parametrize("key", ["activation_checkpointing", "aio", "checkpoint"])
def test_blocks_without_an_off_switch_are_rejected_even_when_empty(key: str) -> None:
    assert load_error({key: {}}).problems[0].path == key


def test_a_disabled_block_needs_an_explicit_false() -> None:
    assert load_error({"autotuning": {"enabled": 0}}).problems[0].path == "autotuning"


@pytest.mark.parametrize("block", ["offload_optimizer", "offload_param"])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_devices_are_not_built(block: str, device: str) -> None:
    config = stage3()
    config["zero_optimization"][block] = {"device": device, "nvme_path": "/local_nvme"}
    (problem,) = load_error(config).problems
    assert problem.message == (
        f'zero_optimization.{block}.device = "{device}": {OFFLOAD_MESSAGE[block]}'
    )


def test_registering_unlocks_offload() -> None:
    register_feature("zero_optimization.offload_optimizer")
    register_feature("zero_optimization.offload_param.device")  # the path the error names
    config = stage3()
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": "/nvme"}
    zero = ZConfig.load(config).zero_optimization
    assert (zero.offload_optimizer_device, zero.offload_param_device) == ("cpu", "nvme")


def test_unlocked_offload_still_checks_how_keys_fit() -> None:
    register_feature("zero_optimization.offload_param")
    register_feature("zero_optimization.offload_optimizer")
    error = load_error(
        {
            "zero_optimization": {
                "stage": 2,
                "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "nvme"},
            }
        }
    )
    messages = sorted(p.message for p in error.problems)
    assert messages == [
        'zero_optimization.offload_optimizer.nvme_path = null: device "nvme" needs nvme_path, '
        "a directory on a local NVMe drive",
        'zero_optimization.offload_param.device = "cpu": offloading parameters needs ZeRO '
        'stage 3 (zero_optimization.stage is 2); set stage to 3 or device to "none"',
    ]


def test_registering_an_unbuilt_block_keeps_it_as_an_extension() -> None:
    register_feature("aio")
    register_feature("zero_optimization.zero_quantized_gradients")
    aio = {"block_size": 1048576, "queue_depth": 8}
    config = stage3(aio=aio)
    config["zero_optimization"]["zero_quantized_gradients"] = True
    cfg = ZConfig.load(config)
    assert cfg.aio is not None and cfg.aio.block_size == 1048576  # a zcore field, validated
    assert cfg.extension("aio") is None
    assert cfg.extension("zero_optimization.zero_quantized_gradients") is True
    assert cfg.extension("moe") is None
    data = cfg.to_dict()
    assert (
        data["aio"]["queue_depth"] == 8
        and data["zero_optimization"]["zero_quantized_gradients"] is True
    )
    assert ZConfig.load(data) == cfg


def test_a_package_can_register_its_own_new_key() -> None:
    assert load_error({"zserve_extra": {"x": 1}}).problems[0].path == "zserve_extra"
    register_feature("zserve_extra")
    assert ZConfig.load({"zserve_extra": {"x": 1}}).extension("zserve_extra") == {"x": 1}


def test_register_feature_rejects_malformed_paths() -> None:
    for bad in ["", ".aio", "aio."]:
        with pytest.raises(ValueError, match="dotted name"):
            register_feature(bad)


def test_stage3_example_is_unaffected_by_gates() -> None:
    ZConfig.load(STAGE3)
