"""build_scheduler, which the engine builds a config's scheduler with; and, where DeepSpeed
is importable (``PYTHONPATH=~/.cache/zstack/deepspeed``, see the Makefile), every schedule
built through it against DeepSpeed's own schedulers."""

from __future__ import annotations

from typing import Any

import pytest

from tests.zcore.lr_schedules.common import make_optimizer
from zcore.lr_schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler


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
    (
        "WarmupLR",
        dict(
            warmup_min_lr=[0.0, 0.02],
            warmup_max_lr=[0.1, 0.2],
            warmup_num_steps=4,
            warmup_type="linear",
        ),
    ),
    ("WarmupLR", {}),
    ("WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1)),
    (
        "WarmupDecayLR",
        dict(total_num_steps=12, warmup_min_lr=0.002, warmup_max_lr=0.05, warmup_num_steps=4),
    ),
    ("WarmupDecayLR", dict(total_num_steps=3, warmup_num_steps=5, warmup_type="linear")),
    (
        "WarmupCosineLR",
        dict(total_num_steps=12, warmup_min_ratio=0.1, warmup_num_steps=4, cos_min_ratio=0.01),
    ),
    (
        "WarmupCosineLR",
        dict(total_num_steps=4, warmup_min_ratio=0.2, warmup_num_steps=6, warmup_type="linear"),
    ),
    (
        "OneCycle",
        dict(
            cycle_min_lr=0.01,
            cycle_max_lr=0.1,
            decay_lr_rate=0.5,
            cycle_first_step_size=4,
            cycle_second_step_size=6,
            decay_step_size=3,
            decay_mom_rate=0.01,
        ),
    ),
    (
        "OneCycle",
        dict(
            cycle_min_lr=[0.01, 0.02],
            cycle_max_lr=0.1,
            cycle_first_step_size=6,
            cycle_second_step_size=4,
            cycle_first_stair_count=3,
            cycle_second_stair_count=2,
        ),
    ),
    (
        "OneCycle",
        dict(
            cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4, cycle_second_step_size=0
        ),
    ),
]


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
    for make in (
        lambda o, **kw: getattr(ds, name)(o, **params, **kw),
        lambda o, **kw: build_scheduler(name, o, {**params, **kw}),
    ):
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
