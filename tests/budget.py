"""The default suite's per-test budget, as a pytest plugin (loaded by tests/conftest.py).

`make test` runs `-m "not slow"` under pytest-timeout's `timeout` from pyproject.toml. This
plugin keeps that budget from eroding silently:

- a default-suite run whose configured timeout passes `DEFAULT_BUDGET_S` is refused at start;
- a default test marked `@pytest.mark.timeout(N)` with N above the budget fails, naming the fix
  (make it cheaper, or mark it `slow`: `make test-slow` runs those);
- a `slow` test without a timeout mark of its own gets `SLOW_TIMEOUT_S`.

It also moves the tests of files marked `heavy` (`pytestmark = pytest.mark.heavy(seconds)`,
the file's rough total on a quiet 2-core machine) to the front, longest first, keeping every
other order: `make test`'s xdist workers take whole files in collection order, so a long file
that came last would leave one worker running it alone at the end.
"""

from __future__ import annotations

import pytest

DEFAULT_BUDGET_S = 60.0
SLOW_TIMEOUT_S = 900.0


def _default_suite(config: pytest.Config) -> bool:
    return "not slow" in (config.getoption("markexpr", "") or "")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a default-suite run (`-m "not slow"`) whose per-test timeout passes the budget."""
    if not _default_suite(config):
        return  # `make test-slow`, or a developer's own selection
    given = config.getoption("timeout", None)
    timeout = float(given if given is not None else config.getini("timeout") or 0)
    if timeout <= 0 or timeout > DEFAULT_BUDGET_S:
        raise pytest.UsageError(
            f"the per-test timeout is {timeout:g} s; the default suite's budget is "
            f"{DEFAULT_BUDGET_S:g} s (pyproject.toml `timeout`): run slow work with `make test-slow`"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`slow` tests without a timeout mark of their own get `SLOW_TIMEOUT_S`; the tests of
    `heavy` files go first."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    items.sort(key=_heavy_first)  # stable: files keep their order otherwise


def _heavy_first(item: pytest.Item) -> float:
    mark = item.get_closest_marker("heavy")
    return 0.0 if mark is None else -float(mark.args[0] if mark.args else 1.0)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A default test marked with a timeout above the budget fails, naming the fix."""
    mark = item.get_closest_marker("timeout")
    if mark is None or item.get_closest_marker("slow") is not None:
        return
    if not _default_suite(item.config):
        return
    seconds = mark.args[0] if mark.args else mark.kwargs.get("timeout", 0)
    if seconds is None or float(seconds) > DEFAULT_BUDGET_S:
        pytest.fail(
            f"marked timeout({seconds}) > the default suite's {DEFAULT_BUDGET_S:g} s budget "
            "without `slow`: make it cheaper, or mark it `slow` (a size or rank-count variant "
            "of a default test; say which in the reason)",
            pytrace=False,
        )
