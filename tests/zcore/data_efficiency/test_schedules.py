"""Each curriculum schedule against its formula, written out here on its own."""

from __future__ import annotations

import math

import pytest

from zcore.data_efficiency import (
    CurriculumScheduler,
    LegacyCurriculumConfig,
    register_curriculum_schedule,
    unregister_curriculum_schedule,
)


def _legacy(schedule_type: str, lo: int, hi: int, **sc: object) -> LegacyCurriculumConfig:
    return LegacyCurriculumConfig(
        enabled=True,
        min_difficulty=lo,
        max_difficulty=hi,
        schedule_type=schedule_type,
        schedule_config=sc,
    )


def _root_reference(step: int, lo: int, hi: int, total: int, multiple: int, degree: int) -> int:
    """DeepSpeed's fixed_root: floor(frac^(1/deg) * (hi - lo) + lo), down to a multiple, <= hi."""
    value = math.floor((step / total) ** (1 / degree) * (hi - lo) + lo)
    return min(value - value % multiple, hi)


def test_fixed_linear_rounds_down_to_difficulty_step_and_stays_at_max() -> None:
    s = CurriculumScheduler(
        _legacy("fixed_linear", 8, 256, total_curriculum_step=100, difficulty_step=8)
    )
    got = [s.update(step) for step in range(1, 131)]
    want = [_root_reference(step, 8, 256, 100, 8, 1) for step in range(1, 131)]
    assert got == want
    assert got[0] == 8 and got[49] == 128 and got[99] == 256 and got[-1] == 256  # steps 1, 50, 100
    assert all(d % 8 == 0 for d in got) and got == sorted(got)
    # (50/100)*(256-8)+8 = 132, rounded down to 128; step 3: floor(15.44) = 15 -> 8
    assert s.difficulty_at(3) == 8 and s.difficulty_at(4) == 16


@pytest.mark.parametrize("degree", [2, 3])
def test_fixed_root(degree: int) -> None:
    s = CurriculumScheduler(
        _legacy(
            "fixed_root", 16, 512, total_curriculum_step=64, difficulty_step=16, root_degree=degree
        )
    )
    for step in range(1, 80):
        assert s.update(step) == _root_reference(step, 16, 512, 64, 16, degree)
    # a root front-loads: at 1/4 of the steps, 0.5 (square) or 0.63 (cube) of the way:
    # 0.5 * 496 + 16 = 264 -> 256; 0.62996 * 496 + 16 = 328.46 -> 320
    assert s.difficulty_at(16) == {2: 256, 3: 320}[degree]


def test_fixed_discrete_follows_max_step() -> None:
    s = CurriculumScheduler(_legacy("fixed_discrete", 1, 3, difficulty=[1, 2, 3], max_step=[5, 10]))
    assert [s.update(step) for step in range(1, 14)] == [1] * 5 + [2] * 5 + [3] * 3


def test_custom_schedule_is_looked_up_by_name() -> None:
    register_curriculum_schedule("seqlen", lambda step: min(64, 8 * step))
    try:
        s = CurriculumScheduler(_legacy("custom", 8, 64))
        assert [s.update(step) for step in (1, 2, 7, 8, 9)] == [8, 16, 56, 64, 64]
    finally:
        unregister_curriculum_schedule("seqlen")
    with pytest.raises(ValueError, match=r"register_curriculum_schedule\('mine', fn\)"):
        CurriculumScheduler(_legacy("custom", 8, 64, name="mine"))


def test_state_round_trip() -> None:
    config = _legacy("fixed_linear", 8, 64, total_curriculum_step=10, difficulty_step=8)
    a = CurriculumScheduler(config)
    for step in range(1, 6):
        a.update(step)
    b = CurriculumScheduler(config)
    b.load_state_dict(a.state_dict())
    assert [a.update(s) for s in range(6, 12)] == [b.update(s) for s in range(6, 12)]
