"""Optimizer and scheduler blocks: types normalized, per-type params with DeepSpeed defaults,
and params.model_dump() usable as constructor keyword arguments."""

from __future__ import annotations

import inspect

import pytest
import torch

from zcore.config import (
    AdagradParams,
    AdamParams,
    LionParams,
    OneCycleConfig,
    SGDParams,
    WarmupCosineLRConfig,
    WarmupLRConfig,
    ZConfig,
)
from zcore.optim import CPULion


def accepts(constructor: type, kwargs: dict) -> None:
    """`constructor(params, **kwargs)` binds (checked on the signature: constructing the first
    torch optimizer in a process costs seconds of lazy imports)."""
    inspect.signature(constructor).bind([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def optimizer(type_: str, **params: object):
    cfg = ZConfig.load({"optimizer": {"type": type_, "params": params}})
    assert cfg.optimizer is not None
    return cfg.optimizer


def scheduler(type_: str, **params: object):
    cfg = ZConfig.load({"scheduler": {"type": type_, "params": params}})
    assert cfg.scheduler is not None
    return cfg.scheduler


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("adam", "Adam"),
        ("ADAMW", "AdamW"),
        ("sgd", "SGD"),
        ("adagrad", "Adagrad"),
        ("lion", "Lion"),
    ],
)
def test_optimizer_type_is_case_insensitive(given: str, canonical: str) -> None:
    assert optimizer(given).type == canonical


def test_adam_follows_deepspeed_adam_w_mode() -> None:
    adam = optimizer("Adam", lr=1e-4, weight_decay=0.01)
    assert isinstance(adam.params, AdamParams) and not adam.reduces_own_gradients
    assert adam.params.adam_w_mode and adam.decoupled_weight_decay  # DeepSpeed's default
    assert not optimizer("Adam", adam_w_mode=False).decoupled_weight_decay
    assert optimizer("AdamW", adam_w_mode=False).decoupled_weight_decay  # ignored, as DeepSpeed


def test_adam_params_dump_is_torch_kwargs() -> None:
    adam = optimizer("Adam", lr=3e-4, betas=[0.9, 0.95], torch_adam=True, adam_w_mode=False)
    kwargs = adam.params.model_dump()
    assert kwargs == {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "amsgrad": False,
    }
    assert adam.params.torch_adam is True and adam.params.adam_w_mode is False
    accepts(torch.optim.Adam, kwargs)


@pytest.mark.parametrize(
    ("type_", "torch_class", "defaults"),
    [
        ("AdamW", torch.optim.AdamW, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}),
        (
            "SGD",
            torch.optim.SGD,
            {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
        ),
        (
            "Adagrad",
            torch.optim.Adagrad,
            {"lr": 1e-2, "eps": 1e-10, "lr_decay": 0.0, "initial_accumulator_value": 0.0},
        ),
    ],
)
def test_params_construct_the_torch_optimizer(type_, torch_class, defaults) -> None:
    kwargs = optimizer(type_).params.model_dump()
    assert defaults.items() <= kwargs.items()
    accepts(torch_class, kwargs)


def test_sgd_and_adagrad_blocks() -> None:
    sgd = optimizer("SGD", lr=0.1, momentum=0.9, nesterov=True)
    assert isinstance(sgd.params, SGDParams) and sgd.decoupled_weight_decay is False
    assert sgd.params.model_dump()["nesterov"] is True
    assert isinstance(optimizer("Adagrad").params, AdagradParams)


def test_lion_params_construct_cpu_lion() -> None:
    lion = optimizer("Lion", weight_decay=0.1)
    assert isinstance(lion.params, LionParams) and lion.decoupled_weight_decay
    kwargs = lion.params.model_dump()
    assert kwargs == {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.1}
    accepts(CPULion, kwargs)


def test_to_dict_keeps_the_deepspeed_switches() -> None:
    cfg = ZConfig.load({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert cfg.to_dict()["optimizer"]["params"]["adam_w_mode"] is False
    assert ZConfig.load(cfg.to_dict()) == cfg


def test_warmup_lr_defaults() -> None:
    warmup = scheduler("warmuplr")
    assert isinstance(warmup, WarmupLRConfig) and warmup.type == "WarmupLR"
    assert warmup.params.model_dump() == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": None,  # DeepSpeed 0.19.8: the optimizer's lr
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    }
    decay = scheduler("WarmupDecayLR", total_num_steps=5000)
    assert decay.params.model_dump()["warmup_max_lr"] == 1e-3  # DeepSpeed's default there


def test_warmup_decay_and_cosine_need_total_steps() -> None:
    decay = scheduler("WarmupDecayLR", total_num_steps=5000, warmup_type="linear")
    assert decay.params.model_dump()["total_num_steps"] == 5000
    cosine = scheduler("WarmupCosineLR", total_num_steps=100)
    assert isinstance(cosine, WarmupCosineLRConfig)
    assert (cosine.params.cos_min_ratio, cosine.params.warmup_min_ratio) == (1e-4, 0.0)


def test_one_cycle() -> None:
    cycle = scheduler("OneCycle", cycle_min_lr=1e-5, cycle_max_lr=1e-3)
    assert isinstance(cycle, OneCycleConfig)
    params = cycle.params.model_dump()
    assert params["cycle_first_step_size"] == 2000 and params["cycle_second_step_size"] is None
    assert (params["cycle_min_mom"], params["cycle_max_mom"]) == (0.8, 0.9)
    assert params["cycle_momentum"] is True


@pytest.mark.parametrize("type_", ["WarmupDecayLR", "WarmupCosineLR"])
@pytest.mark.parametrize("total", [3, 10])
def test_total_steps_not_above_warmup_is_accepted_as_deepspeed(type_: str, total: int) -> None:
    # DeepSpeed runs these (logging a warning when the schedule is built); so does zstack.
    cfg = scheduler(type_, total_num_steps=total, warmup_num_steps=10)
    assert (cfg.params.total_num_steps, cfg.params.warmup_num_steps) == (total, 10)


def test_one_cycle_second_step_size_may_be_zero() -> None:
    cycle = scheduler("OneCycle", cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_second_step_size=0)
    assert cycle.params.cycle_second_step_size == 0
