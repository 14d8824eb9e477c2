"""WarmupLR, WarmupDecayLR and WarmupCosineLR against DeepSpeed's formulas written out
here, independently of the implementation: warmup boundaries, decay end, cosine floor,
per-group values, and the warning when there is no decay phase."""

from __future__ import annotations

import logging
import math

import pytest
from torch.optim.lr_scheduler import LRScheduler

from tests.zcore.lr_schedules.common import make_optimizer, run, warmup_gamma
from zcore.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR


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
