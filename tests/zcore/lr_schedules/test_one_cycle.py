"""OneCycle against DeepSpeed's 1Cycle formulas written out here: the peak, trough and
stairs, momentum moving inversely, the decay after the cycle, per-group values."""

from __future__ import annotations

import pytest

from tests.zcore.lr_schedules.common import make_optimizer, run
from zcore.lr_schedules import OneCycle


def test_one_cycle_values_written_out_from_deepspeed():
    """Runs worked out by hand from DeepSpeed 0.19.8's code: the lrs (and momentum) of
    optimizer steps 1, 2, 3, ..."""
    cycle = OneCycle(
        make_optimizer("adam"),
        0.01,
        0.1,
        decay_lr_rate=1.0,
        cycle_first_step_size=3,
        decay_step_size=2,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
    )
    lrs, moms = [], []
    for _ in range(9):
        lrs.append(cycle.optimizer.param_groups[0]["lr"])
        moms.append(cycle.optimizer.param_groups[0]["betas"][0])
        cycle.optimizer.step()
        cycle.step()
    assert lrs == pytest.approx([0.01, 0.04, 0.07, 0.1, 0.07, 0.04, 0.01, 0.01 / 1.5, 0.005])
    # step 1 at cycle_min_mom: DeepSpeed's constructor sets it (the cycle would say max)
    assert moms == pytest.approx(
        [0.8, 0.9 - 0.1 / 3, 0.9 - 0.2 / 3, 0.8, 0.9 - 0.2 / 3, 0.9 - 0.1 / 3, 0.9, 0.9, 0.9]
    )
    stairs = OneCycle(
        make_optimizer("adagrad"), 0.0, 1.0, cycle_first_step_size=4, cycle_first_stair_count=2
    )
    assert [lr for (lr,) in run(stairs, 10)] == pytest.approx(
        [0.0, 0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0]
    )


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
