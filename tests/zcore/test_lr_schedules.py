"""zcore.lr_schedules against DeepSpeed's formulas written out here, independently of the
implementation: warmup boundaries, decay end, cosine floor, the 1Cycle peak, trough and
stairs with momentum moving inversely, per-group values, state-dict resume, bad args;
and, where DeepSpeed is importable (``PYTHONPATH=~/.cache/zstack/deepspeed``, see the
Makefile), against DeepSpeed's own schedulers.

Convention checked throughout, DeepSpeed's: the scheduler is stepped after each optimizer
step, so optimizer step 1 runs at the value the constructor sets (DeepSpeed's iteration
-1) and step ``k >= 2`` at the schedule's iteration ``k - 2``."""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler

from zcore.lr_schedules import (
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def make_optimizer(kind: str = "sgd", lrs: tuple[float, ...] = (0.1,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": lr} for lr in lrs]
    if kind == "adam":
        return torch.optim.Adam(groups, betas=(0.9, 0.95))
    if kind == "sgd":
        return torch.optim.SGD(groups, momentum=0.5)
    if kind == "adagrad":
        return torch.optim.Adagrad(groups)
    raise AssertionError(kind)


def run(sched: Any, steps: int) -> list[list[float]]:
    """The lrs optimizer steps 1..steps run at, driven as DeepSpeed's engine drives a
    scheduler: optimizer.step(), then scheduler.step()."""
    out = []
    for _ in range(steps):
        lrs = [float(g["lr"]) for g in sched.optimizer.param_groups]
        if isinstance(sched, LRScheduler):
            assert lrs == [float(lr) for lr in sched.get_last_lr()]
        out.append(lrs)
        sched.optimizer.step()
        sched.step()
    return out


def warmup_gamma(k: int, w: int, kind: str) -> float:
    return math.log(k + 1) / math.log(w) if kind == "log" else k / w


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    lo, hi, w = 0.01, 0.1, 10
    opt = make_optimizer()
    sched = WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=w, warmup_type=kind)
    assert isinstance(sched, LRScheduler)
    assert sched.last_epoch == sched.last_batch_iteration == -1  # not started, as DeepSpeed
    got = [lr for (lr,) in run(sched, 25)]
    assert got[0] == lo  # step 1: the constructor's value, warmup_min_lr
    for step in range(2, 26):
        k = step - 2
        want = lo + (hi - lo) * warmup_gamma(k, w, kind) if k < w else hi
        assert got[step - 1] == pytest.approx(want, rel=1e-12), step
    assert got[1] == lo  # iteration 0 is warmup_min_lr too: DeepSpeed runs it twice
    assert got[w + 1] == hi
    if kind == "log":
        assert got[w] == pytest.approx(hi)  # iteration w-1: log(w) / log(w), already at max
    assert sched.last_batch_iteration == 24


def test_values_written_out_from_deepspeed():
    """A few runs worked out by hand from DeepSpeed 0.19.8's code: the lrs of optimizer
    steps 1, 2, 3, ..."""
    warmup = WarmupLR(make_optimizer(), 0.0, 0.1, warmup_num_steps=4, warmup_type="linear")
    assert [lr for (lr,) in run(warmup, 7)] == pytest.approx(
        [0.0, 0.0, 0.025, 0.05, 0.075, 0.1, 0.1]
    )
    decay = WarmupDecayLR(make_optimizer(), 6, 0.0, 0.1, warmup_num_steps=2, warmup_type="linear")
    assert [lr for (lr,) in run(decay, 9)] == pytest.approx(
        [0.0, 0.0, 0.05, 0.1, 0.075, 0.05, 0.025, 0.0, 0.0]
    )
    cosine = WarmupCosineLR(make_optimizer(lrs=(0.2,)), 8, 0.1, 4, 0.0, "linear")
    assert [lr for (lr,) in run(cosine, 10)] == pytest.approx(
        # step 1 at 0 (not warmup_min_ratio); then 0.2 x (0.1, 0.325, 0.55, 0.775), then
        # 0.2 x (1 + cos(pi t / 4)) / 2 for t = 1..4, held at the floor
        [0.0, 0.02, 0.065, 0.11, 0.155, 0.17071067811865475, 0.1, 0.029289321881345247, 0, 0],
        abs=1e-15,
    )
    cycle = OneCycle(
        make_optimizer("adam"), 0.01, 0.1, decay_lr_rate=1.0, cycle_first_step_size=3,
        decay_step_size=2, cycle_min_mom=0.8, cycle_max_mom=0.9,
    )  # fmt: skip
    lrs, moms = [], []
    for _ in range(9):
        lrs.append(cycle.optimizer.param_groups[0]["lr"])
        moms.append(cycle.optimizer.param_groups[0]["betas"][0])
        cycle.optimizer.step()
        cycle.step()
    assert lrs == pytest.approx([0.01, 0.04, 0.07, 0.1, 0.07, 0.04, 0.01, 0.01 / 1.5, 0.005])
    # step 1 at cycle_min_mom: DeepSpeed's constructor sets it (the cycle would say max)
    assert moms == pytest.approx([0.8, 0.9 - 0.1 / 3, 0.9 - 0.2 / 3, 0.8, 0.9 - 0.2 / 3,
                                  0.9 - 0.1 / 3, 0.9, 0.9, 0.9])  # fmt: skip
    stairs = OneCycle(
        make_optimizer("adagrad"), 0.0, 1.0, cycle_first_step_size=4, cycle_first_stair_count=2
    )
    assert [lr for (lr,) in run(stairs, 10)] == pytest.approx(
        [0.0, 0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0]
    )


def test_warmup_lr_per_group_lists():
    opt = make_optimizer("adam", lrs=(1.0, 1.0))
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.3], warmup_num_steps=4)
    got = run(sched, 8)
    assert got[0] == [0.0, 0.01]
    for step in range(2, 9):
        k = step - 2
        g = math.log(k + 1) / math.log(4) if k < 4 else 1.0
        assert got[step - 1] == pytest.approx([0.1 * g, 0.01 + 0.29 * g], rel=1e-12)


def test_warmup_max_lr_defaults_to_the_optimizer_lr():
    # DeepSpeed 0.19.8: WarmupLR's warmup_max_lr=None takes each group's lr.
    sched = WarmupLR(make_optimizer(lrs=(0.4, 0.2)), warmup_num_steps=2, warmup_type="linear")
    got = [lr for lrs in run(sched, 5) for lr in lrs]
    assert got == pytest.approx([0, 0, 0, 0, 0.2, 0.1, 0.4, 0.2, 0.4, 0.2])


def test_warmup_num_steps_one_behaves_like_deepspeed():
    # DeepSpeed clamps warmup_num_steps to 2 so that log(warmup_num_steps) != 0.
    got = run(WarmupLR(make_optimizer(), 0.0, 1.0, warmup_num_steps=1, warmup_type="linear"), 5)
    assert [lr for (lr,) in got] == pytest.approx([0.0, 0.0, 0.5, 1.0, 1.0])


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("lo", [0.0, 0.002])
def test_warmup_decay_lr(kind, lo):
    hi, w, total = 0.05, 5, 15
    sched = WarmupDecayLR(
        make_optimizer(),
        total_num_steps=total,
        warmup_min_lr=lo,
        warmup_max_lr=hi,
        warmup_num_steps=w,
        warmup_type=kind,
    )
    got = [lr for (lr,) in run(sched, 25)]
    assert got[0] == lo
    for step in range(2, 26):
        k = step - 2
        g = warmup_gamma(k, w, kind) if k < w else max(0.0, (total - k) / (total - w))
        assert got[step - 1] == pytest.approx(lo + (hi - lo) * g, rel=1e-12, abs=1e-15), step
    assert got[w + 1] == pytest.approx(hi)  # decay starts from the peak at iteration w
    assert got[total + 1] == pytest.approx(lo)  # and reaches warmup_min_lr at total_num_steps
    assert got[total + 1 :] == pytest.approx([lo] * (24 - total))


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind):
    bases, w, total, r0, rmin = (0.2, 0.1), 4, 12, 0.1, 0.01
    sched = WarmupCosineLR(
        make_optimizer("adam", lrs=bases),
        total_num_steps=total,
        warmup_min_ratio=r0,
        warmup_num_steps=w,
        cos_min_ratio=rmin,
        warmup_type=kind,
    )
    got = run(sched, 20)
    assert got[0] == [0.0, 0.0]  # DeepSpeed's ratio before the schedule starts
    for step in range(2, 21):
        k = step - 2
        if k < w:
            ratio = r0 + (1 - r0) * warmup_gamma(k, w, kind)
        else:
            t = min(k - w + 1, total - w)
            ratio = rmin + (1 - rmin) * 0.5 * (1 + math.cos(math.pi * t / (total - w)))
        assert got[step - 1] == pytest.approx([b * ratio for b in bases], rel=1e-12), step
    assert got[1] == pytest.approx([b * r0 for b in bases])
    # The cosine floor is reached at iteration total-1 and held afterwards (no climb back up).
    for step in range(total + 1, 21):
        assert got[step - 1] == pytest.approx([b * rmin for b in bases])
    assert all(a[0] >= b[0] for a, b in zip(got[w + 1 :], got[w + 2 :], strict=False))


def triangle(k: int, first: int, second: int) -> float:
    """1Cycle height at iteration k: position k+1 on a rise of `first`, a fall of `second`."""
    p = k + 1
    return p / first if p <= first else (first + second - p) / second


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_one_cycle_lr_and_momentum(kind):
    lo, hi, first, second = 0.01, 0.1, 4, 6
    mlo, mhi, decay_size, lr_rate, mom_rate = 0.8, 0.9, 3, 0.5, 0.01
    opt = make_optimizer(kind)
    sched = OneCycle(
        opt,
        cycle_min_lr=lo,
        cycle_max_lr=hi,
        decay_lr_rate=lr_rate,
        cycle_first_step_size=first,
        cycle_second_step_size=second,
        decay_step_size=decay_size,
        cycle_min_mom=mlo,
        cycle_max_mom=mhi,
        decay_mom_rate=mom_rate,
    )
    total = first + second
    lrs, moms = [], []
    for _ in range(20):
        group = opt.param_groups[0]
        lrs.append(group["lr"])
        if kind == "adam":
            moms.append(group["betas"][0])
            assert group["betas"][1] == 0.95  # beta2 is the optimizer's, untouched
        else:
            moms.append(group["momentum"])
        opt.step()
        sched.step()
    assert (lrs[0], moms[0]) == (lo, mlo)  # what DeepSpeed's constructor sets
    for step in range(2, 21):
        k = step - 2
        if k < total:
            s = triangle(k, first, second)
            want_lr, want_mom = lo + (hi - lo) * s, mhi - (mhi - mlo) * s
        else:
            d = (k - total + 1) / decay_size
            want_lr, want_mom = lo / (1 + lr_rate * d), mhi * (1 + mom_rate * d)
        assert lrs[step - 1] == pytest.approx(want_lr, rel=1e-12), step
        assert moms[step - 1] == pytest.approx(want_mom, rel=1e-12), step
    assert max(lrs) == pytest.approx(hi) and lrs.index(max(lrs)) == first  # step first+1
    assert min(moms[1:total]) == pytest.approx(mlo) and moms.index(min(moms[1:]), 1) == first
    assert lrs[total] == pytest.approx(lo) and moms[total] == pytest.approx(mhi)


def test_one_cycle_without_decay_holds_the_trough():
    sched = OneCycle(make_optimizer("adam"), 0.01, 0.1, cycle_first_step_size=3)
    got = [lr for (lr,) in run(sched, 12)]
    assert got[3] == pytest.approx(0.1)
    assert got[6:] == pytest.approx([0.01] * 6)
    assert sched.optimizer.param_groups[0]["betas"][0] == pytest.approx(0.9)


def test_one_cycle_second_step_size_zero_is_a_sawtooth():
    # DeepSpeed accepts cycle_second_step_size=0: the lr climbs for the whole cycle and is
    # back at the bottom on its last iteration, never reaching cycle_max_lr.
    sched = OneCycle(make_optimizer("adagrad"), 0.0, 1.0, 0.0, 4, cycle_second_step_size=0)
    assert [lr for (lr,) in run(sched, 7)] == pytest.approx([0, 0.25, 0.5, 0.75, 0, 0, 0])


def test_one_cycle_per_group_and_no_momentum_optimizer():
    opt = make_optimizer("adagrad", lrs=(1.0, 1.0))
    sched = OneCycle(opt, cycle_min_lr=[0.0, 0.1], cycle_max_lr=[1.0, 0.2], cycle_first_step_size=2)
    got = run(sched, 5)
    assert [lr for lrs in got for lr in lrs] == pytest.approx(
        [0.0, 0.1, 0.5, 0.15, 1.0, 0.2, 0.5, 0.15, 0.0, 0.1]
    )
    assert not sched.cycle_momentum
    assert "betas" not in opt.param_groups[0] and "momentum" not in opt.param_groups[0]


def test_one_cycle_momentum_off_leaves_optimizer_momentum():
    opt = make_optimizer("sgd")
    run(OneCycle(opt, 0.01, 0.1, cycle_first_step_size=2, cycle_momentum=False), 3)
    assert opt.param_groups[0]["momentum"] == 0.5


def _schedulers() -> dict[str, Callable[..., Any]]:
    return {
        "WarmupLR": lambda o, **kw: WarmupLR(o, 0.0, 0.1, 6, "linear", **kw),
        "WarmupDecayLR": lambda o, **kw: WarmupDecayLR(o, 20, 0.01, 0.1, 5, **kw),
        "WarmupCosineLR": lambda o, **kw: WarmupCosineLR(o, 20, 0.1, 5, 0.01, **kw),
        "OneCycle": lambda o, **kw: OneCycle(
            o, 0.01, 0.1, cycle_first_step_size=4, decay_step_size=2, decay_lr_rate=0.1, **kw
        ),
    }


@pytest.mark.parametrize("name", list(_schedulers()))
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_state_dict_round_trip_continues_identically(name, kind):
    make = _schedulers()[name]
    opt = make_optimizer(kind, lrs=(0.3, 0.7))
    sched = make(opt)
    run(sched, 7)
    assert sched.state_dict() == {"last_batch_iteration": 6}  # DeepSpeed's, after 7 steps
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    expected = run(sched, 15)
    moms = [g.get("betas", g.get("momentum")) for g in opt.param_groups]

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    opt2 = make_optimizer(kind, lrs=(0.3, 0.7))
    sched2 = make(opt2)  # as an engine does: build the scheduler, then load both states
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert sched2.last_batch_iteration == 6
    assert sched2.get_last_lr() == expected[0]
    assert run(sched2, 15) == expected
    assert [g.get("betas", g.get("momentum")) for g in opt2.param_groups] == moms


def test_load_state_dict_takes_older_zcore_checkpoints_and_refuses_others():
    sched = WarmupLR(make_optimizer(), 0.0, 0.1, 6, "linear")
    sched.load_state_dict({"last_epoch": 3, "base_lrs": [0.1], "_step_count": 4})
    assert sched.last_batch_iteration == 3
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)  # iteration 3
    sched.last_batch_iteration = 5  # DeepSpeed's attribute, writable as there
    assert sched.last_epoch == 5
    with pytest.raises(KeyError, match="needs `last_batch_iteration`"):
        sched.load_state_dict({"step": 3})


@pytest.mark.parametrize("how", ["constructor", "load_state_dict"])
@pytest.mark.parametrize("name", list(_schedulers()))
def test_last_batch_iteration_resumes_as_an_uninterrupted_run(name, how):
    make = _schedulers()[name]
    reference = run(make(make_optimizer("adam", lrs=(0.3,))), 12)
    opt = make_optimizer("adam", lrs=(0.3,))
    # last_batch_iteration=n means batches 0..n are done: the optimizer gets iteration n's
    # values, which an uninterrupted run's optimizer step n+2 runs at. (DeepSpeed's
    # constructor and load_state_dict leave the lr alone; the optimizer's state restores it.)
    if how == "constructor":
        sched = make(opt, last_batch_iteration=5)
    else:
        sched = make(opt)
        sched.load_state_dict({"last_batch_iteration": 5})
    assert sched.last_batch_iteration == 5
    assert sched.get_last_lr() == reference[6]
    got = run(sched, 5)
    assert got == reference[6:11]
    moms = [g["betas"][0] for g in opt.param_groups]
    assert moms == [g["betas"][0] for g in reference_optimizer_after(make, 11).param_groups]


def reference_optimizer_after(make: Callable[..., Any], steps: int) -> torch.optim.Optimizer:
    opt = make_optimizer("adam", lrs=(0.3,))
    run(make(opt), steps)
    return opt


def test_total_steps_not_above_warmup_warns_and_runs_like_deepspeed(caplog):
    with caplog.at_level(logging.WARNING, logger="zcore.lr_schedules"):
        decay = WarmupDecayLR(make_optimizer(), 3, 0.01, 0.1, 4, "linear")
    assert "total_num_steps 3 is not greater than warmup_num_steps 4" in caplog.text
    assert [lr for (lr,) in run(decay, 8)] == pytest.approx(
        [0.01, 0.01, 0.0325, 0.055, 0.0775, 0.01, 0.01, 0.01]
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zcore.lr_schedules"):
        cosine = WarmupCosineLR(make_optimizer(lrs=(1.0,)), 4, 0.0, 4, 0.05, "linear")
    assert "total_num_steps 4 is not greater than warmup_num_steps 4" in caplog.text
    assert [lr for (lr,) in run(cosine, 8)] == pytest.approx(
        [0.0, 0.0, 0.25, 0.5, 0.75, 0.05, 0.05, 0.05]
    )


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda o: WarmupLR(o, warmup_num_steps=0),
            "warmup_num_steps must be an integer >= 1, got 0",
        ),
        (lambda o: WarmupLR(o, warmup_num_steps=2.5), "warmup_num_steps .* got 2.5"),
        (lambda o: WarmupLR(o, warmup_type="cosine"), "warmup_type .*'cosine'"),
        (lambda o: WarmupLR(o, warmup_min_lr=[0.0, 0.1]), "warmup_min_lr has 2 values .* 1 param"),
        (lambda o: WarmupLR(o, warmup_max_lr=-1.0), "warmup_max_lr must be >= 0, got -1.0"),
        (lambda o: WarmupLR(o, last_batch_iteration=-2), "last_batch_iteration .* got -2"),
        (lambda o: WarmupDecayLR(o, total_num_steps=0), "total_num_steps .* >= 1, got 0"),
        (lambda o: WarmupCosineLR(o, 10, warmup_num_steps=0), "warmup_num_steps .* got 0"),
        (lambda o: WarmupCosineLR(o, 2000, cos_min_ratio=1.5), "cos_min_ratio .* got 1.5"),
        (lambda o: WarmupCosineLR(o, 2000, warmup_min_ratio=-0.1), "warmup_min_ratio .* -0.1"),
        (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0), "cycle_first_step_size .* 0"),
        (lambda o: OneCycle(o, 0.1, 1.0, cycle_second_step_size=-3), "cycle_second_step_size"),
        (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_stair_count=-1), "cycle_first_stair_count"),
        (lambda o: OneCycle(o, 0.1, 1.0, decay_step_size=-1), "decay_step_size .* -1"),
        (lambda o: OneCycle(o, [0.1, 0.2], 1.0), "cycle_min_lr has 2 values"),
    ],
)
def test_bad_arguments_raise(build, match):
    with pytest.raises(ValueError, match=match):
        build(make_optimizer())


def test_not_an_optimizer():
    with pytest.raises(TypeError, match=r"not a torch\.optim\.Optimizer"):
        WarmupLR(object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "params", "cls"),
    [
        ("WarmupLR", {"warmup_max_lr": 0.1, "warmup_num_steps": 5}, WarmupLR),
        ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 5}, WarmupDecayLR),
        ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 5}, WarmupCosineLR),
        ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}, OneCycle),
    ],
)
def test_build_scheduler(name, params, cls):
    sched = build_scheduler(name, make_optimizer(), params)
    assert type(sched) is cls


def test_build_scheduler_errors():
    with pytest.raises(
        ValueError, match=r"'Cosine'.*WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle"
    ):
        build_scheduler("Cosine", make_optimizer(), {})
    with pytest.raises(ValueError, match=r"unknown params \['warmup_steps'\].*warmup_num_steps"):
        build_scheduler("WarmupLR", make_optimizer(), {"warmup_steps": 5})
    with pytest.raises(ValueError, match=r"needs params \['total_num_steps'\]"):
        build_scheduler("WarmupDecayLR", make_optimizer(), {"warmup_num_steps": 5})


# -- against DeepSpeed itself, where it is importable ------------------------------------

#: (type, params) run through both implementations; the optimizer has lrs (0.3, 0.7).
DEEPSPEED_CASES: list[tuple[str, dict[str, Any]]] = [
    ("WarmupLR", dict(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=5)),
    ("WarmupLR", dict(warmup_min_lr=[0.0, 0.02], warmup_max_lr=[0.1, 0.2], warmup_num_steps=4,
                      warmup_type="linear")),
    ("WarmupLR", {}),
    ("WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1)),
    ("WarmupDecayLR", dict(total_num_steps=12, warmup_min_lr=0.002, warmup_max_lr=0.05,
                           warmup_num_steps=4)),
    ("WarmupDecayLR", dict(total_num_steps=3, warmup_num_steps=5, warmup_type="linear")),
    ("WarmupCosineLR", dict(total_num_steps=12, warmup_min_ratio=0.1, warmup_num_steps=4,
                            cos_min_ratio=0.01)),
    ("WarmupCosineLR", dict(total_num_steps=4, warmup_min_ratio=0.2, warmup_num_steps=6,
                            warmup_type="linear")),
    ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, decay_lr_rate=0.5,
                      cycle_first_step_size=4, cycle_second_step_size=6, decay_step_size=3,
                      decay_mom_rate=0.01)),
    ("OneCycle", dict(cycle_min_lr=[0.01, 0.02], cycle_max_lr=0.1, cycle_first_step_size=6,
                      cycle_second_step_size=4, cycle_first_stair_count=3,
                      cycle_second_stair_count=2)),
    ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
                      cycle_second_step_size=0)),
]  # fmt: skip


def deepspeed_schedules() -> Any:
    """DeepSpeed's ``lr_schedules`` module, or a skip: never a dependency, see the Makefile's
    ``DS_DIR`` (run with ``PYTHONPATH=~/.cache/zstack/deepspeed``)."""
    return pytest.importorskip("deepspeed.runtime.lr_schedules")


def lrs_and_beta1(sched: Any, steps: int) -> list[list[float]]:
    """[lr, betas[0]] of each group in turn at optimizer steps 1..steps, driven as
    DeepSpeed's engine drives its scheduler."""
    out = []
    for _ in range(steps):
        groups = sched.optimizer.param_groups
        out.append([float(v) for g in groups for v in (g["lr"], g["betas"][0])])
        sched.optimizer.step()
        sched.step()
    return out


@pytest.mark.parametrize(("name", "params"), DEEPSPEED_CASES)
def test_same_lr_and_momentum_as_deepspeed(name: str, params: dict[str, Any]) -> None:
    ds = deepspeed_schedules()
    runs = []
    for make in (
        lambda o: getattr(ds, name)(o, **params),
        lambda o: build_scheduler(name, o, params),
    ):
        runs.append(lrs_and_beta1(make(make_optimizer("adam", lrs=(0.3, 0.7))), 30))
    theirs, ours = runs
    for step, (a, b) in enumerate(zip(theirs, ours, strict=True), start=1):
        assert b == pytest.approx(a, rel=1e-12, abs=1e-15), f"optimizer step {step}"


@pytest.mark.parametrize(("name", "params"), DEEPSPEED_CASES[::3])
def test_resume_matches_deepspeed(name: str, params: dict[str, Any]) -> None:
    """Save after 7 steps, build afresh with ``last_batch_iteration`` and load both states:
    the next steps run as DeepSpeed's do after the same resume."""
    ds = deepspeed_schedules()
    runs = []
    for make in (lambda o, **kw: getattr(ds, name)(o, **params, **kw),
                 lambda o, **kw: build_scheduler(name, o, {**params, **kw})):  # fmt: skip
        opt = make_optimizer("adam", lrs=(0.3, 0.7))
        sched = make(opt)
        lrs_and_beta1(sched, 7)
        state = {"opt": opt.state_dict(), "sched": sched.state_dict()}
        opt2 = make_optimizer("adam", lrs=(0.3, 0.7))
        sched2 = make(opt2, last_batch_iteration=3)  # overwritten by the loaded state
        opt2.load_state_dict(state["opt"])
        sched2.load_state_dict(state["sched"])
        runs.append((state["sched"], lrs_and_beta1(sched2, 20)))
    (their_state, theirs), (our_state, ours) = runs
    assert our_state == their_state
    for step, (a, b) in enumerate(zip(theirs, ours, strict=True), start=1):
        assert b == pytest.approx(a, rel=1e-12, abs=1e-15), f"optimizer step {step} after resume"
