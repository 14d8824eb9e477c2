"""The weight budget's plan: sizes parsed, resident layers spread over the depth, the slots,
and the named error for a budget below one layer (no model needed)."""

from __future__ import annotations

import pytest

from zserve.offload import OffloadSpec, WeightsBudgetError, parse_size, plan_layers


@pytest.mark.parametrize(
    ("text", "n"),
    [("123", 123), ("64M", 64 << 20), ("1.5G", 3 << 29), ("200MiB", 200 << 20), ("8kb", 8192)],
)
def test_parse_size(text: str, n: int) -> None:
    assert parse_size(text) == n


def test_parse_size_refuses_words() -> None:
    with pytest.raises(ValueError, match=r"is not a size.*`128M`"):
        parse_size("lots")


def test_plan_fits_resident_layers_beside_the_slots() -> None:
    plan = plan_layers([10] * 30, OffloadSpec(budget=100))
    assert plan.slots == 2 and len(plan.resident) == 8 and plan.held_bytes == 100
    assert plan.streamed == [i for i in range(30) if i not in plan.resident]
    gaps = {b - a for a, b in zip(plan.resident, plan.resident[1:], strict=False)}
    assert max(gaps) - min(gaps) <= 1, plan.resident  # spread evenly
    deeper = plan_layers([10] * 30, OffloadSpec(budget=100, prefetch=3))
    assert deeper.slots == 4 and len(deeper.resident) == 6


def test_plan_everything_resident_when_it_fits() -> None:
    plan = plan_layers([10] * 4, OffloadSpec(budget=40))
    assert plan.streamed == [] and plan.slots == 0


def test_one_layer_budget_streams_through_one_slot() -> None:
    plan = plan_layers([10] * 4, OffloadSpec(budget=15))
    assert plan.slots == 1 and plan.resident == [] and plan.streamed == [0, 1, 2, 3]


def test_budget_below_one_layer_is_named() -> None:
    with pytest.raises(WeightsBudgetError, match=r"budget 9 bytes .* smaller than one decoder"):
        plan_layers([10] * 4, OffloadSpec(budget=9))


def test_spec_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="needs a directory"):
        OffloadSpec(budget=10, kind="nvme")
    with pytest.raises(ValueError, match="is for offload 'nvme'"):
        OffloadSpec(budget=10, kind="cpu", directory="/tmp")
