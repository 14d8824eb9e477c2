"""What every schedule shares: state-dict round trips, resuming at
``last_batch_iteration`` as an uninterrupted run, and the argument checks."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.zcore.lr_schedules.common import make_optimizer, run, schedulers
from zcore.lr_schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


@pytest.mark.parametrize("name", list(schedulers()))
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_state_dict_round_trip_continues_identically(name, kind):
    make = schedulers()[name]
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
@pytest.mark.parametrize("name", list(schedulers()))
def test_last_batch_iteration_resumes_as_an_uninterrupted_run(name, how):
    make = schedulers()[name]
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
