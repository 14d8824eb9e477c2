"""zcore.lr_schedules against closed-form formulas written out here, independently of
the implementation: warmup boundaries, decay end, cosine floor, the 1Cycle peak and
trough with momentum moving inversely, per-group values, state-dict resume, bad args.

Convention checked throughout: after construction plus ``k`` calls of ``step()`` the
optimizer holds the schedule's value at iteration ``k`` (DeepSpeed's
``last_batch_iteration``)."""

from __future__ import annotations

import io
import math

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


def run(sched: LRScheduler, steps: int) -> list[list[float]]:
    """lrs at iterations 0..steps-1, checking the optimizer agrees with get_last_lr()."""
    out = []
    for _ in range(steps):
        lrs = [float(g["lr"]) for g in sched.optimizer.param_groups]
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
    got = run(sched, 25)
    for k, (lr,) in enumerate(got):
        want = lo + (hi - lo) * warmup_gamma(k, w, kind) if k < w else hi
        assert lr == pytest.approx(want, rel=1e-12), k
    assert got[0] == [lo]  # the lr before the first optimizer step is warmup_min_lr
    assert got[w] == [hi]
    if kind == "log":
        assert got[w - 1][0] == pytest.approx(hi)  # log(w) / log(w): already at max


def test_warmup_lr_per_group_lists():
    opt = make_optimizer("adam", lrs=(1.0, 1.0))
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.3], warmup_num_steps=4)
    got = run(sched, 8)
    for k, lrs in enumerate(got):
        g = math.log(k + 1) / math.log(4) if k < 4 else 1.0
        assert lrs == pytest.approx([0.1 * g, 0.01 + 0.29 * g], rel=1e-12)


def test_warmup_num_steps_one_behaves_like_deepspeed():
    # DeepSpeed clamps warmup_num_steps to 2 so that log(warmup_num_steps) != 0.
    got = run(WarmupLR(make_optimizer(), 0.0, 1.0, warmup_num_steps=1, warmup_type="linear"), 4)
    assert [lr for (lr,) in got] == pytest.approx([0.0, 0.5, 1.0, 1.0])


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
    for k, lr in enumerate(got):
        g = warmup_gamma(k, w, kind) if k < w else max(0.0, (total - k) / (total - w))
        assert lr == pytest.approx(lo + (hi - lo) * g, rel=1e-12, abs=1e-15), k
    assert got[w] == pytest.approx(hi)  # decay starts from the peak
    assert got[total] == pytest.approx(lo)  # and ends at warmup_min_lr
    assert got[total:] == pytest.approx([lo] * (25 - total))


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
    for k, lrs in enumerate(got):
        if k < w:
            ratio = r0 + (1 - r0) * warmup_gamma(k, w, kind)
        else:
            t = min(k - w + 1, total - w)
            ratio = rmin + (1 - rmin) * 0.5 * (1 + math.cos(math.pi * t / (total - w)))
        assert lrs == pytest.approx([b * ratio for b in bases], rel=1e-12), k
    assert got[0] == pytest.approx([b * r0 for b in bases])
    # The cosine floor is reached at total-1 and held afterwards (no climb back up).
    for k in range(total - 1, 20):
        assert got[k] == pytest.approx([b * rmin for b in bases])
    assert all(a[0] >= b[0] for a, b in zip(got[w:], got[w + 1 :], strict=False))


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
    for k in range(20):
        if k < total:
            s = triangle(k, first, second)
            want_lr, want_mom = lo + (hi - lo) * s, mhi - (mhi - mlo) * s
        else:
            d = (k - total + 1) / decay_size
            want_lr, want_mom = lo / (1 + lr_rate * d), mhi * (1 + mom_rate * d)
        assert lrs[k] == pytest.approx(want_lr, rel=1e-12), k
        assert moms[k] == pytest.approx(want_mom, rel=1e-12), k
    assert max(lrs) == pytest.approx(hi) and lrs.index(max(lrs)) == first - 1
    assert min(moms[:total]) == pytest.approx(mlo) and moms.index(min(moms)) == first - 1
    assert lrs[total - 1] == pytest.approx(lo) and moms[total - 1] == pytest.approx(mhi)


def test_one_cycle_without_decay_holds_the_trough():
    sched = OneCycle(make_optimizer("adam"), 0.01, 0.1, cycle_first_step_size=3)
    got = [lr for (lr,) in run(sched, 12)]
    assert got[2] == pytest.approx(0.1)
    assert got[5:] == pytest.approx([0.01] * 7)
    assert sched.optimizer.param_groups[0]["betas"][0] == pytest.approx(0.9)


def test_one_cycle_per_group_and_no_momentum_optimizer():
    opt = make_optimizer("adagrad", lrs=(1.0, 1.0))
    sched = OneCycle(opt, cycle_min_lr=[0.0, 0.1], cycle_max_lr=[1.0, 0.2], cycle_first_step_size=2)
    got = run(sched, 4)
    assert [lr for lrs in got for lr in lrs] == pytest.approx(
        [0.5, 0.15, 1.0, 0.2, 0.5, 0.15, 0.0, 0.1]
    )
    assert not sched.cycle_momentum
    assert "betas" not in opt.param_groups[0] and "momentum" not in opt.param_groups[0]


def test_one_cycle_momentum_off_leaves_optimizer_momentum():
    opt = make_optimizer("sgd")
    run(OneCycle(opt, 0.01, 0.1, cycle_first_step_size=2, cycle_momentum=False), 3)
    assert opt.param_groups[0]["momentum"] == 0.5


def _schedulers():
    return {
        "WarmupLR": lambda o: WarmupLR(o, 0.0, 0.1, 6, "linear"),
        "WarmupDecayLR": lambda o: WarmupDecayLR(o, 20, 0.01, 0.1, 5),
        "WarmupCosineLR": lambda o: WarmupCosineLR(o, 20, 0.1, 5, 0.01),
        "OneCycle": lambda o: OneCycle(
            o, 0.01, 0.1, cycle_first_step_size=4, decay_step_size=2, decay_lr_rate=0.1
        ),
    }


@pytest.mark.parametrize("name", list(_schedulers()))
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_state_dict_round_trip_continues_identically(name, kind):
    make = _schedulers()[name]
    opt = make_optimizer(kind, lrs=(0.3, 0.7))
    sched = make(opt)
    run(sched, 7)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    expected = run(sched, 15)
    moms = [g.get("betas", g.get("momentum")) for g in opt.param_groups]

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    opt2 = make_optimizer(kind, lrs=(0.3, 0.7))
    sched2 = make(opt2)  # torch: build the scheduler, then load the optimizer state
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert sched2.last_epoch == 7
    assert run(sched2, 15) == expected
    assert [g.get("betas", g.get("momentum")) for g in opt2.param_groups] == moms


@pytest.mark.parametrize("name", list(_schedulers()))
def test_last_batch_iteration_resumes_on_a_fresh_optimizer(name):
    make = _schedulers()[name]
    reference = run(make(make_optimizer(lrs=(0.3,))), 12)
    opt = make_optimizer(lrs=(0.3,))
    # As DeepSpeed: last_batch_iteration=n means batches 0..n are done; the next is n+1.
    kwargs = {"last_batch_iteration": 5}
    sched = {
        "WarmupLR": lambda: WarmupLR(opt, 0.0, 0.1, 6, "linear", **kwargs),
        "WarmupDecayLR": lambda: WarmupDecayLR(opt, 20, 0.01, 0.1, 5, **kwargs),
        "WarmupCosineLR": lambda: WarmupCosineLR(opt, 20, 0.1, 5, 0.01, **kwargs),
        "OneCycle": lambda: OneCycle(
            opt, 0.01, 0.1, cycle_first_step_size=4, decay_step_size=2, decay_lr_rate=0.1, **kwargs
        ),
    }[name]()
    assert run(sched, 6) == reference[6:]


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
        (
            lambda o: WarmupDecayLR(o, total_num_steps=100, warmup_num_steps=100),
            "total_num_steps 100 must be greater than warmup_num_steps 100",
        ),
        (
            lambda o: WarmupCosineLR(o, total_num_steps=10, warmup_num_steps=20),
            "total_num_steps 10 must be greater than warmup_num_steps 20",
        ),
        (lambda o: WarmupCosineLR(o, 2000, cos_min_ratio=1.5), "cos_min_ratio .* got 1.5"),
        (lambda o: WarmupCosineLR(o, 2000, warmup_min_ratio=-0.1), "warmup_min_ratio .* -0.1"),
        (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0), "cycle_first_step_size .* 0"),
        (lambda o: OneCycle(o, 0.1, 1.0, cycle_second_step_size=-3), "cycle_second_step_size"),
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
