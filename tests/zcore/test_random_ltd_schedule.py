"""Random-LTD's schedule and LayerToken learning rate against their formulas, and its config
block: DeepSpeed's keys load, bad values fail at load naming the key and the fix."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from zcore.config import ConfigError, ZConfig
from zcore.data_efficiency.random_ltd_config import RandomLTDConfig
from zcore.data_efficiency.random_ltd_schedule import RandomLTDScheduler
from zcore.lr_schedules.layer_token import LayerTokenLR, layer_token_factor

# DeepSpeed's random-LTD tutorial block (GPT-3 350M: 24 layers, 2048 tokens), as written there
LTD: dict[str, Any] = {
    "enabled": True,
    "total_layer_num": 24,
    "random_ltd_layer_num": 22,
    "random_ltd_layer_id": list(range(1, 23)),
    "model_mask_name": "attention_mask",
    "model_type": "decoder",
    "hidden_state_order": "seq_batch_dim",
    "random_ltd_schedule": {
        "min_value": 128,
        "max_value": 2048,
        "schedule_type": "fixed_linear",
        "schedule_config": {"require_steps": 200000, "seq_per_step": 16},
    },
    "layer_token_lr_schedule": {
        "enabled": True,
        "total_layer_tokens": 10**12,
        "warmup_type": "linear",
        "warmup_layer_tokens": 10**10,
    },
}
PATH = "data_efficiency.data_routing.random_ltd"


def _full(block: dict[str, Any]) -> dict[str, Any]:
    return {
        "train_batch_size": 8,
        "data_efficiency": {
            "enabled": True,
            "data_routing": {"enabled": True, "random_ltd": block},
        },
    }


def _with(key: str, value: Any) -> dict[str, Any]:
    block = copy.deepcopy(LTD)
    *parents, last = key.split(".")
    node = block
    for p in parents:
        node = node[p]
    node[last] = value
    return _full(block)


def test_the_tutorial_block_loads() -> None:
    de = ZConfig.load(_full(LTD)).extension("data_efficiency")
    r = de.random_ltd
    assert r is not None and r.random_ltd_schedule.max_value == 2048
    assert r.layer_token_lr_schedule.warmup_layer_tokens == 10**10


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (
            "random_ltd_layer_id",
            [0, *range(2, 23)],
            "has [0] outside [1, 22]: with total_layer_num 24 the first (0) and last (23)",
        ),
        ("random_ltd_layer_id", [*range(1, 22), 23], "has [23] outside [1, 22]"),
        ("random_ltd_layer_id", [*range(1, 22), 40], "has [40] outside [1, 22]"),
        ("random_ltd_layer_id", [*range(1, 22), 1], "names a layer twice"),
        (
            "random_ltd_layer_num",
            21,
            "random_ltd_layer_num = 21: but random_ltd_layer_id names 22 layers",
        ),
        (
            "random_ltd_schedule.min_value",
            4096,
            "random_ltd_schedule.min_value = 4096: is above max_value 2048",
        ),
        (
            "random_ltd_schedule.min_value",
            100,
            "is not a multiple of schedule_config.seq_per_step 16",
        ),
        ("random_ltd_schedule.schedule_type", "fixed_root", "random_ltd_schedule.schedule_type"),
        ("random_ltd_schedule.schedule_config.require_steps", None, "require_steps: is required"),
        ("random_ltd_schedule.schedule_config.seq_per_stp", 16, "unknown key"),
        ("model_type", "seq2seq", "model_type"),
        ("hidden_state_order", "batch_first", "hidden_state_order"),
        ("total_layer_num", None, "total_layer_num: is required when random_ltd is enabled"),
        (
            "layer_token_lr_schedule.warmup_layer_tokens",
            10**12,
            "warmup_layer_tokens = 1000000000000: is not below total_layer_tokens",
        ),
        (
            "layer_token_lr_schedule.total_layer_tokens",
            None,
            "total_layer_tokens: is required when enabled",
        ),
        ("layer_token_lr_schedule.total_layer_token", 5, "unknown key"),
        ("layer_token_lr_schedule.warmup_type", "cosine", "warmup_type"),
    ],
)
def test_bad_values_name_the_key(key: str, value: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        ZConfig.load(_with(key, value))
    message = str(err.value)
    assert expected in message, message
    assert f"{PATH}." in message


def test_parents_must_be_enabled() -> None:
    off = _full(LTD)
    off["data_efficiency"]["data_routing"]["enabled"] = False
    with pytest.raises(
        ConfigError, match=r"data_routing\.enabled = false: random_ltd needs it true"
    ):
        ZConfig.load(off)
    off = _full(LTD)
    off["data_efficiency"]["enabled"] = False
    with pytest.raises(ConfigError, match=r"data_routing\.random_ltd needs it true"):
        ZConfig.load(off)


def test_kept_tokens_and_layer_tokens_follow_the_formula() -> None:
    cfg = RandomLTDConfig.model_validate(LTD)
    s = RandomLTDScheduler(cfg, global_batch_size=8)
    for step in (0, 1, 999, 50_000, 123_457, 199_999, 200_000, 10**6):
        value = math.floor(step / 200_000 * (2048 - 128) + 128)
        assert s.keep_at(step) == min(value - value % 16, 2048), step
    assert s.keep_at(0) == 128 and s.keep_at(200_000) == 2048
    tokens = sum(8 * (s.keep_at(t) * 22 + 2048 * 2) for t in range(300))
    assert s.layer_tokens_before(300) == tokens
    assert s.layer_tokens_before(0) == 0 and s.layer_tokens_before(2) == 2 * 8 * (128 * 22 + 4096)
    s.update(299)
    assert s.current == s.keep_at(299) and s.consumed_layer_tokens == tokens


@pytest.mark.parametrize("warmup_type", ["linear", "log"])
def test_layer_token_lr_values_equal_the_formula(warmup_type: str) -> None:
    total, warmup, peak = 10_000, 2_000, 0.5
    per_step = [300 + 17 * k for k in range(40)]  # layer-tokens of each step, growing

    def before(steps: int) -> int:
        return sum(per_step[:steps])

    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=peak)
    sched = LayerTokenLR(opt, total, before, warmup, warmup_type)
    for k in range(1, 40):  # optimizer step k runs at the layer-tokens of the k - 1 before it
        c = before(k - 1)
        if c < warmup:
            want = c / warmup if warmup_type == "linear" else math.log1p(c) / math.log1p(warmup)
        else:
            want = 0.5 * (1 + math.cos(math.pi * min(1.0, (c - warmup) / (total - warmup))))
        assert opt.param_groups[0]["lr"] == pytest.approx(peak * want, rel=1e-12, abs=1e-15), k
        opt.step()
        sched.step()
    assert layer_token_factor(total + 5, total, warmup, "linear") == pytest.approx(0.0, abs=1e-15)
    resumed = LayerTokenLR(torch.optim.SGD([param], lr=peak), total, before, warmup, warmup_type)
    resumed.load_state_dict(sched.state_dict())
    assert resumed.get_last_lr() == sched.get_last_lr()


def test_layer_token_lr_checks_its_arguments() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(
        ValueError, match="warmup_layer_tokens 10 must be below total_layer_tokens 10"
    ):
        LayerTokenLR(opt, 10, lambda n: 0, 10)
    with pytest.raises(ValueError, match="warmup_type must be 'linear' or 'log'"):
        LayerTokenLR(opt, 10, lambda n: 0, 1, "cosine")
