"""Optimizers and schedules from the config or passed in, monitors, engine queries."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, full_params, global_batch, make_model, train
from zcore.lr_schedules import build_scheduler

STEPS = 5

OPTIMIZERS: dict[str, tuple[dict[str, Any], Any]] = {
    "Adam": (
        {"lr": 2e-3, "weight_decay": 0.01, "adam_w_mode": False},
        lambda ps: torch.optim.Adam(ps, lr=2e-3, weight_decay=0.01),
    ),
    "SGD": (
        {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01},
        lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9, weight_decay=0.01),
    ),
    "Adagrad": ({"lr": 5e-2}, lambda ps: torch.optim.Adagrad(ps, lr=5e-2)),
}


def _reference(make_opt: Any, clip: float = 0.5) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = make_opt(model.parameters())
    for step in range(STEPS):
        x, y = global_batch(step, 8)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _with_optimizer(rank: int, world: int, kind: str, params: dict, stage: int) -> dict:
    # global batch 8 for any world size: micro 4/world x accumulation 2 x world
    cfg = config(stage, mb=4 // world, optimizer={"type": kind, "params": params})
    engine, *_ = zcore.initialize(make_model(), config=cfg)
    train(engine, STEPS)
    return full_params(engine)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_config_optimizers_match_torch(kind: str) -> None:
    params, make_opt = OPTIMIZERS[kind]
    ref = _reference(make_opt)
    for got in run_ranks(_with_optimizer, 2, args=(kind, params, 2)):
        for name, value in ref.items():
            torch.testing.assert_close(got[name], value, atol=1e-4, rtol=0, msg=name)


def test_lion_sharded_matches_lion_whole() -> None:
    """Lion steps by sign(update): a gradient summed in another order can flip the sign of
    an update that is ~0, moving that element by 2·lr. Everything else must match."""
    params = {"lr": 1e-3, "weight_decay": 0.1}
    whole = _with_optimizer(0, 1, "Lion", params, 0)  # one process, stage 0
    for got in run_ranks(_with_optimizer, 2, args=("Lion", params, 3)):
        for name, value in whole.items():
            diff = (got[name] - value).abs()
            assert float(diff.max()) <= 2 * params["lr"] * STEPS + 1e-6, name
            assert float((diff > 1e-5).float().mean()) < 0.002, name


def _client_optimizer(rank: int, world: int) -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9, weight_decay=0.01)
    cfg = config(3)
    del cfg["optimizer"]
    engine, inner, _, sched = zcore.initialize(
        model, optimizer=opt, config=cfg,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=1.0),
    )  # fmt: skip
    assert isinstance(inner, torch.optim.SGD) and sched.optimizer is inner
    train(engine, STEPS)
    return full_params(engine)


def test_torch_optimizer_passed_in_is_partitioned() -> None:
    ref = _reference(OPTIMIZERS["SGD"][1])
    for got in run_ranks(_client_optimizer, 2):
        for name, value in ref.items():
            torch.testing.assert_close(got[name], value, atol=1e-4, rtol=0, msg=name)


def test_scheduler_from_config_steps_once_per_optimizer_step(tmp_path: Path) -> None:
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                            "warmup_num_steps": 4, "warmup_type": "linear"}}  # fmt: skip
    cfg = config(1, mb=2, gas=2, scheduler=sched, steps_per_print=2, wall_clock_breakdown=True)
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}
    engine, *_ = zcore.initialize(make_model(), config=cfg)
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    expected = build_scheduler("WarmupLR", probe, sched["params"])
    seen, want = [], []
    for _ in range(6):
        train(engine, 1, start=engine.global_steps)
        probe.step()
        expected.step()
        seen.append(engine.get_lr()[0])
        want.append(expected.get_last_lr()[0])
    assert seen == pytest.approx(want)
    assert engine.get_global_grad_norm() is not None and engine.get_global_grad_norm() > 0
    with open(tmp_path / "job" / "Train_Samples_lr.csv") as f:
        rows = list(csv.reader(f))
    assert len(rows) == 7 and float(rows[-1][1]) == pytest.approx(seen[-1])


def test_train_eval_and_accumulation_boundaries() -> None:
    engine, *_ = zcore.initialize(make_model(), config=config(0, mb=2, gas=3))
    assert engine.train() is engine and engine.module.training
    engine.eval()
    assert not engine.module.training
    engine.train()
    x, y = global_batch(0, 2)
    boundaries = []
    for _ in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x, y))
        engine.step()
    assert boundaries == [False, False, True, False, False, True]
    assert engine.global_steps == 2 and engine.micro_steps == 6


def _stage2_with(rank: int, world: int, extra: dict[str, Any]) -> dict:
    cfg = config(2, **extra)
    engine, *_ = zcore.initialize(make_model(), config=cfg)
    train(engine, STEPS)
    return full_params(engine)


@pytest.mark.parametrize(
    "extra",
    [
        {"zero_optimization": {"reduce_scatter": False}},
        # divide by 4 before the sum and multiply by 4/2 after: the same average
        {"prescale_gradients": True, "gradient_predivide_factor": 4.0},
        {"zero_optimization": {"allgather_partitions": False}},
    ],
    ids=["reduce_scatter_false", "prescale_gradients", "allgather_partitions_false"],
)
def test_reduction_options_give_the_same_result(extra: dict[str, Any]) -> None:
    ref = _reference(lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01))
    for got in run_ranks(_stage2_with, 2, args=(extra,)):
        for name, value in ref.items():
            torch.testing.assert_close(got[name], value, atol=1e-4, rtol=0, msg=name)


def _save_16bit(rank: int, world: int, out: str, gather: bool) -> str:
    cfg = config(3, bf16={"enabled": True},
                 zero_optimization={"stage3_gather_16bit_weights_on_model_save": gather})  # fmt: skip
    engine, *_ = zcore.initialize(make_model(), config=cfg)
    try:
        engine.save_16bit_model(out)
    except ValueError as err:
        return str(err)
    return "saved"


def test_save_16bit_model_at_stage3(tmp_path: Path) -> None:
    refused = run_ranks(_save_16bit, 2, args=(str(tmp_path), False))
    assert all("stage3_gather_16bit_weights_on_model_save" in r for r in refused)
    assert run_ranks(_save_16bit, 2, args=(str(tmp_path), True)) == ["saved", "saved"]
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    model = make_model()
    assert state["blocks.0.fc.weight"].dtype == torch.bfloat16
    model.load_state_dict({k: v.float() for k, v in state.items()})
    torch.testing.assert_close(model.blocks[0].fc.weight, make_model().blocks[0].fc.weight,
                               atol=1e-2, rtol=0)  # fmt: skip
