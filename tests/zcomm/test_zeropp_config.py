"""Bad ZeRO++ configs fail at start with the key, the value and the fix; good ones claim the
collectives only when a part is on."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

import zcomm.zeropp.extension  # noqa: F401  (registers the keys, as the entry point does)
from zcomm.zeropp import LocoConfig, ZeroPPConfig
from zcore.comm.mesh import MeshError, spec_from_config
from zcore.config import ConfigError, ZConfig
from zcore.zero.collectives import Collectives, collectives_for


def _config(stage: int = 3, **zero: Any) -> ZConfig:
    return ZConfig.load(
        {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage, **zero}}
    )


BAD = [
    (
        {"stage": 2, "zero_quantized_weights": True},
        r"zero_optimization\.zero_quantized_weights = true: .*needs ZeRO stage 3 .*stage is 2.*set "
        r"zero_optimization\.stage to 3",
    ),
    (
        {"stage": 1, "zero_hpz_partition_size": 2},
        r"zero_optimization\.zero_hpz_partition_size = 2: .*stage 3",
    ),
    (
        {"stage": 2, "zero_quantized_gradients": True},
        r"zero_optimization\.zero_quantized_gradients = true: .*stage 3",
    ),
    (
        {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset": 9}},
        r"zero_optimization\.zeropp_loco_param\.reset = 9: unknown LoCo key; DeepSpeed's are "
        r"err_beta and reset_T",
    ),
    (
        {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 1.5}},
        r"zeropp_loco_param\.err_beta = 1\.5: must be a number in \[0, 1\)",
    ),
    (
        {"zero_quantized_gradients": True, "zeropp_loco_param": {"reset_T": 0}},
        r"zeropp_loco_param\.reset_T = 0: must be a positive whole number",
    ),
    (
        {"zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}},
        r"zeropp_loco_param = .*qgZ's quantized gradients, which are off; set "
        r"zero_optimization\.zero_quantized_gradients to true",
    ),
    (
        {"zero_quantized_gradients": True, "reduce_scatter": False},
        r"zero_quantized_gradients = true: .*reduce_scatter is false.*set reduce_scatter to true",
    ),
    ({"zero_quantized_weights": "yes"}, r"zero_quantized_weights = \"yes\": must be true or false"),
    ({"zero_hpz_partition_size": 0}, r"zero_hpz_partition_size = 0: must be a positive"),
]


@pytest.mark.parametrize(("zero", "message"), BAD)
def test_bad_config_names_the_key_and_the_fix(zero: dict[str, Any], message: str) -> None:
    stage = zero.pop("stage", 3)
    with pytest.raises(ConfigError, match=message):
        ZeroPPConfig.from_config(_config(stage, **zero))


def test_every_problem_is_listed_at_once() -> None:
    cfg = _config(2, zero_quantized_weights=True, zeropp_loco_param={"bad": 1})
    with pytest.raises(ConfigError) as err:
        ZeroPPConfig.from_config(cfg)
    paths = [p.path for p in err.value.problems]
    assert "zero_optimization.zero_quantized_weights" in paths
    assert "zero_optimization.zeropp_loco_param.bad" in paths


def test_engine_refuses_at_start() -> None:
    from torch import nn

    import zcore

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1, "zero_quantized_weights": True},
    }
    with pytest.raises(ConfigError, match="zero_quantized_weights"):
        zcore.initialize(nn.Linear(2, 2), config=cfg)


def test_hpz_that_does_not_divide_dp_names_the_key() -> None:
    with pytest.raises(
        MeshError,
        match=r"zero_hpz_partition_size\) does not divide dp 4.*"
        r"choose one that divides 4",
    ):
        spec_from_config(_config(zero_hpz_partition_size=3), 4)


def test_reads_deepspeeds_keys() -> None:
    cfg = _config(
        zero_quantized_weights=True,
        zero_quantized_gradients=True,
        zero_hpz_partition_size=8,
        zeropp_loco_param={"err_beta": 0.5, "reset_T": 64},
    )
    assert ZeroPPConfig.from_config(cfg) == ZeroPPConfig(True, 8, True, LocoConfig(0.5, 64))
    defaults = ZeroPPConfig.from_config(
        _config(zero_quantized_gradients=True, zeropp_loco_param={})
    )
    assert defaults.loco == LocoConfig(0.8, 1024)


def test_claims_only_when_a_part_is_on() -> None:
    assert type(collectives_for(_config(), None)) is Collectives
    assert not ZeroPPConfig.from_config(_config(zero_hpz_partition_size=1)).enabled


def test_keys_reach_zcomm_when_the_config_loads_first() -> None:
    code = (
        "from zcore.config import ZConfig\n"
        "c = ZConfig.load({'train_micro_batch_size_per_gpu': 1, 'zero_optimization': "
        "{'stage': 3, 'zero_quantized_weights': True}})\n"
        "print(c.extension('zero_optimization.zero_quantized_weights'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
