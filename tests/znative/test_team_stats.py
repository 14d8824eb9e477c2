"""znative.team_stats(): the kernels' team counters (``zkernels::team::stats``) are exposed,
never go down, and count a parallel kernel call as a loop on the team or one run alone."""

from __future__ import annotations

import numpy as np

import znative

KEYS = {"loops", "stood_down", "tasks", "helped", "late", "idle", "waited_ns"}


def test_counters_count_kernel_calls() -> None:
    before = znative.team_stats()
    assert set(before) == KEYS
    x = np.ones((4, 1024), np.float32)
    w = np.ones((4096, 1024), np.float32)
    out = np.empty((4, 4096), np.float32)
    for _ in range(5):
        znative.linear_rows(x, w, out)
    after = znative.team_stats()
    assert all(after[k] >= before[k] for k in KEYS)
    assert after["helped"] <= after["tasks"]
    if znative.num_threads() > 1:  # each call ran on the team or alone while it stood down
        ran = after["loops"] + after["stood_down"] - before["loops"] - before["stood_down"]
        assert ran >= 5
