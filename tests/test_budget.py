"""tests/budget.py, run as it runs in `make test`: a pytest subprocess with the plugin loaded
on a generated test file (no torch import, about a second each)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from tests.budget import DEFAULT_BUDGET_S

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parent.parent

TESTS = """
import pytest

@pytest.mark.timeout(120)
def test_marked_past_the_budget():
    pass

@pytest.mark.slow
@pytest.mark.timeout(120)
def test_slow_and_long():
    pass

@pytest.mark.slow
def test_slow_unmarked(request):
    assert request.node.get_closest_marker("timeout").args == (900.0,)

def test_plain():
    pass
"""


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_budgeted=TESTS)
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\ntimeout = 60\n")
    return pytester.runpytest_subprocess("-p", "tests.budget", "-p", "no:cacheprovider", *args)


@pytest.fixture
def pytester_root(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # `-p tests.budget` imports from the repo
    return pytester


def test_a_default_test_marked_past_the_budget_fails_naming_the_fix(
    pytester_root: pytest.Pytester,
) -> None:
    result = _run(pytester_root, "-m", "not slow")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*marked timeout(120) > the default suite's 60 s budget*slow*"])


def test_slow_tests_keep_their_own_timeout_or_get_the_slow_one(
    pytester_root: pytest.Pytester,
) -> None:
    _run(pytester_root, "-m", "slow").assert_outcomes(passed=2)


def test_a_default_run_with_a_longer_timeout_is_refused(pytester_root: pytest.Pytester) -> None:
    result = _run(pytester_root, "-m", "not slow", "--timeout", str(DEFAULT_BUDGET_S + 1))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*per-test timeout is 61 s; the default suite's budget is 60 s*"])


def test_the_repository_default_is_within_the_budget() -> None:
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 0 < float(ini["timeout"]) <= DEFAULT_BUDGET_S


def test_heavy_files_go_first_longest_first(pytester_root: pytest.Pytester) -> None:
    pytester_root.makepyfile(
        test_a="def test_a():\n    pass\n",
        test_b="import pytest\npytestmark = pytest.mark.heavy(60)\ndef test_b():\n    pass\n",
        test_c="import pytest\npytestmark = pytest.mark.heavy(300)\ndef test_c():\n    pass\n",
        test_d="def test_d():\n    pass\n",
    )
    pytester_root.makeini("[pytest]\nmarkers =\n    heavy: heavy\n")
    result = pytester_root.runpytest_subprocess("-p", "tests.budget", "--collect-only", "-q")
    ids = [line for line in result.stdout.lines if "::" in line]
    assert ids == [
        "test_c.py::test_c",
        "test_b.py::test_b",
        "test_a.py::test_a",
        "test_d.py::test_d",
    ]
