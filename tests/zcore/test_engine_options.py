"""Optimizers and schedules from the config or passed in, monitors, engine queries."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, full_params, global_batch, make_model, train
from zcore.config import ConfigError

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
        model,
        optimizer=opt,
        config=cfg,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=1.0),
    )
    assert isinstance(inner, torch.optim.SGD) and sched.optimizer is inner
    train(engine, STEPS)
    return full_params(engine)


def test_torch_optimizer_passed_in_is_partitioned() -> None:
    ref = _reference(OPTIMIZERS["SGD"][1])
    for got in run_ranks(_client_optimizer, 2):
        for name, value in ref.items():
            torch.testing.assert_close(got[name], value, atol=1e-4, rtol=0, msg=name)


def _lrs_used(engine: Any, steps: int) -> list[list[float]]:
    """[lr, betas[0]] that the engine's optimizer reads at each of its next ``steps`` steps."""
    used: list[list[float]] = []

    def record(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        group = opt.param_groups[0]
        used.append([float(group["lr"]), float(group.get("betas", (float("nan"),))[0])])

    handle = engine.optimizer.register_step_pre_hook(record)
    try:
        train(engine, steps, start=engine.global_steps)
    finally:
        handle.remove()
    assert len(used) == steps
    return used


def test_scheduler_from_config_steps_as_deepspeed(tmp_path: Path) -> None:
    # DeepSpeed builds the schedule at iteration -1 (warmup_min_lr) and steps it after each
    # optimizer step: steps 1 and 2 run at warmup_min_lr, step k >= 2 at iteration k - 2.
    sched = {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 1e-3,
            "warmup_max_lr": 1e-2,
            "warmup_num_steps": 4,
            "warmup_type": "linear",
        },
    }
    cfg = config(1, mb=2, gas=2, scheduler=sched, steps_per_print=2, wall_clock_breakdown=True)
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}
    engine, *_ = zcore.initialize(make_model(), config=cfg)
    assert engine.lr_scheduler.last_batch_iteration == -1
    assert engine.get_lr() == [1e-3]
    used = [lr for lr, _ in _lrs_used(engine, 7)]
    assert used == pytest.approx([1e-3, 1e-3, 3.25e-3, 5.5e-3, 7.75e-3, 1e-2, 1e-2])
    assert engine.lr_scheduler.state_dict() == {"last_batch_iteration": 6}
    assert engine.get_global_grad_norm() is not None and engine.get_global_grad_norm() > 0
    with open(tmp_path / "job" / "Train_Samples_lr.csv") as f:
        rows = list(csv.reader(f))
    assert len(rows) == 8 and float(rows[-1][1]) == pytest.approx(engine.get_lr()[0])


#: Schedules run by the engine and by DeepSpeed's own scheduler (single values: the engine
#: builds one param group here; the optimizer's lr is the config's 3e-3).
ENGINE_CASES: list[dict[str, Any]] = [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_num_steps": 5}},
    {
        "type": "WarmupDecayLR",
        "params": {
            "total_num_steps": 8,
            "warmup_max_lr": 5e-3,
            "warmup_num_steps": 3,
            "warmup_type": "linear",
        },
    },
    {"type": "WarmupDecayLR", "params": {"total_num_steps": 2, "warmup_num_steps": 4}},
    {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": 9,
            "warmup_min_ratio": 0.1,
            "warmup_num_steps": 3,
            "cos_min_ratio": 0.01,
        },
    },
    {
        "type": "OneCycle",
        "params": {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 5e-3,
            "cycle_first_step_size": 3,
            "cycle_second_step_size": 2,
            "decay_step_size": 2,
            "decay_lr_rate": 0.5,
            "decay_mom_rate": 0.02,
        },
    },
    {
        "type": "OneCycle",
        "params": {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 5e-3,
            "cycle_first_step_size": 4,
            "cycle_first_stair_count": 2,
        },
    },
]


def _deepspeed_lrs(ds: Any, block: dict[str, Any], steps: int) -> list[list[float]]:
    """DeepSpeed's scheduler driven as its engine drives it (``_take_model_step``: the
    optimizer steps, then the scheduler), over a torch optimizer with the config's lr."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-3)
    sched = getattr(ds, block["type"])(opt, **block["params"])
    used = []
    for _ in range(steps):
        used.append([float(opt.param_groups[0]["lr"]), float(opt.param_groups[0]["betas"][0])])
        opt.step()
        sched.step()
    return used


@pytest.mark.parametrize("block", ENGINE_CASES, ids=lambda b: b["type"])
def test_engine_runs_deepspeeds_learning_rates(block: dict[str, Any]) -> None:
    ds = pytest.importorskip("deepspeed.runtime.lr_schedules")  # PYTHONPATH=<Makefile DS_DIR>
    engine, *_ = zcore.initialize(make_model(), config=config(1, mb=2, gas=1, scheduler=block))
    ours = _lrs_used(engine, 12)
    theirs = _deepspeed_lrs(ds, block, 12)
    for step, (a, b) in enumerate(zip(theirs, ours, strict=True), start=1):
        assert b == pytest.approx(a, rel=1e-12, abs=1e-15), f"optimizer step {step}"


def test_bad_scheduler_config_fails_before_the_model_is_touched() -> None:
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    block = {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 0}}
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_num_steps = 0: must be >= 1"):
        zcore.initialize(model, config=config(3, scheduler=block))
    # Not partitioned, not cast, no hooks: the same model trains under a good config.
    for name, p in model.named_parameters():
        assert p.data.shape == before[name].shape and torch.equal(p.data, before[name]), name
        assert p.dtype == torch.float32 and not hasattr(p, "_z_on_edit"), name
        assert not p._post_accumulate_grad_hooks, name
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks, module
    # warmup_num_steps above total_num_steps: DeepSpeed warns and runs, so does zcore
    block["params"] = {"total_num_steps": 5, "warmup_num_steps": 10}
    engine, *_ = zcore.initialize(model, config=config(3, scheduler=block))
    losses = train(engine, 2)
    assert engine.global_steps == 2 and all(math.isfinite(loss) for loss in losses)


def _save_with_schedule(ckpt: str, steps: int, block: dict[str, Any]) -> list[list[float]]:
    engine, *_ = zcore.initialize(make_model(), config=config(2, mb=2, gas=1, scheduler=block))
    used = _lrs_used(engine, steps)
    engine.save_checkpoint(ckpt)
    return used


@pytest.mark.parametrize("optimizer_states", [True, False])
def test_checkpoint_resume_continues_the_schedule(tmp_path: Path, optimizer_states: bool) -> None:
    block = ENGINE_CASES[4]  # OneCycle: lr and momentum both scheduled
    uninterrupted = _save_with_schedule(str(tmp_path / "a"), 10, block)
    assert _save_with_schedule(str(tmp_path / "b"), 4, block) == uninterrupted[:4]
    engine, *_ = zcore.initialize(
        make_model(seed=5), config=config(2, mb=2, gas=1, scheduler=block)
    )
    engine.load_checkpoint(str(tmp_path / "b"), load_optimizer_states=optimizer_states)
    assert engine.lr_scheduler.state_dict() == {"last_batch_iteration": 3}
    assert _lrs_used(engine, 6) == uninterrupted[4:]


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
    cfg = config(
        3,
        bf16={"enabled": True},
        zero_optimization={"stage3_gather_16bit_weights_on_model_save": gather},
    )
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
    torch.testing.assert_close(
        model.blocks[0].fc.weight, make_model().blocks[0].fc.weight, atol=1e-2, rtol=0
    )
