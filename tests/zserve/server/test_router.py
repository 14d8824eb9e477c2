"""The router's least-loaded choice: fewest in flight wins, ties rotate, down replicas are
skipped, and with none live there is no choice."""

from __future__ import annotations

import pytest

from zserve.server.replicas import Replica
from zserve.server.router import Router


def _replicas(n: int) -> list[Replica]:
    # the choice reads only index/health/in-flight; no process is needed to test it
    return [
        Replica(index=i, host="127.0.0.1", port=1000 + i, process=None, healthy=True)
        for i in range(n)
    ]


def test_ties_rotate_so_sequential_requests_spread() -> None:
    router = Router(_replicas(3))
    picks = [router.pick().index for _ in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]


def test_fewest_in_flight_wins() -> None:
    reps = _replicas(3)
    router = Router(reps)
    reps[0].in_flight, reps[1].in_flight, reps[2].in_flight = 5, 1, 3
    assert router.pick().index == 1
    # simulate the proxy: each pick adds one in flight to the chosen replica
    counts = {0: 0, 1: 0, 2: 0}
    for _ in range(9):
        rep = router.pick()
        rep.in_flight += 1
        counts[rep.index] += 1
    # 9 more on top of (5, 1, 3): least-loaded fills up to (6, 6, 6)
    assert [r.in_flight for r in reps] == [6, 6, 6]
    assert counts == {0: 1, 1: 5, 2: 3}


def test_down_and_excluded_replicas_are_skipped() -> None:
    reps = _replicas(2)
    router = Router(reps)
    router.mark_down(reps[0], "connect failed")
    assert reps[0].last_error == "connect failed"
    assert [router.pick().index for _ in range(3)] == [1, 1, 1]
    assert router.pick(exclude=frozenset({1})) is None
    router.mark_down(reps[1], "process 1 exited (-9)")
    assert router.pick() is None and router.live() == []


def test_needs_a_replica() -> None:
    with pytest.raises(ValueError, match="at least one replica"):
        Router([])
