"""Test-wide settings.

Hypothesis runs derandomized: every run (and CI) explores the same examples, so
a failure reproduces and a green run means the same thing each time. Set
`HYPOTHESIS_PROFILE=explore` to draw fresh examples while developing.

Every test runs on one torch intra-op thread: CI and dev machines run the suite on
few cores beside other work, where torch's pool spends most of its time waiting for
a descheduled worker (a 100-token SmolLM2 forward measured 0.7 s on one thread against
4-7 s on two; the tiny-GPT overfit loop ran 10x slower). Multi-rank tests set the same
in each rank (`tests.utils.distributed`).

The default suite (`make test`, `-m "not slow"`) has a per-test budget: pytest-timeout's
`timeout` in pyproject.toml, at most `DEFAULT_BUDGET_S`. A test that needs more is a `slow`
test (`make test-slow`); collection fails when a default test is marked with a longer
`@pytest.mark.timeout`, or the configured timeout exceeds the budget, so the budget cannot
erode silently.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

# The per-test budget of the default suite, in seconds (issue: the suite fits CI).
DEFAULT_BUDGET_S = 60.0
# A `slow` test without a timeout mark of its own gets this one.
SLOW_TIMEOUT_S = 900.0

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give `slow` tests their longer timeout; refuse a default-suite run whose per-test
    timeout, or any default test's own, passes the budget."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    markexpr = config.getoption("markexpr", "") or ""
    if "not slow" not in markexpr:
        return  # `make test-slow`, or a developer's own selection
    problems = []
    configured = float(config.getini("timeout") or 0)
    given = config.getoption("timeout", None)
    timeout = float(given) if given is not None else configured
    if timeout <= 0 or timeout > DEFAULT_BUDGET_S:
        problems.append(
            f"the per-test timeout is {timeout:g} s; the default suite's budget is "
            f"{DEFAULT_BUDGET_S:g} s (pyproject.toml `timeout`)"
        )
    for item in items:
        mark = item.get_closest_marker("timeout")
        if mark is None or item.get_closest_marker("slow") is not None:
            continue
        seconds = mark.args[0] if mark.args else mark.kwargs.get("timeout", 0)
        if seconds is None or float(seconds) > DEFAULT_BUDGET_S:
            problems.append(
                f"{item.nodeid} is marked timeout({seconds}) > the {DEFAULT_BUDGET_S:g} s budget "
                "without `slow`: make it cheaper, or mark it `slow` (a size or rank-count "
                "variant of a default test; say which in the reason)"
            )
    if problems:
        raise pytest.UsageError("per-test budget:\n  " + "\n  ".join(problems))
