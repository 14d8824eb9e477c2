"""Run every `slow` test, one pytest process per test directory, and say what each part cost.

`make test-slow` calls this. One process for the whole lane held every module's real models and
rank pools in one heap: it grew to ~10 GB by its 89th percent and was the OOM killer's choice on
a 24 GiB machine with anything beside it. A process per directory (the files directly in it,
never its subdirectories, so no test runs twice) frees that memory between parts at the cost of
one interpreter start each.

The parts come from one `pytest -m slow --collect-only`, so a new slow test anywhere is picked
up without a list to keep. Each part prints its own `--durations`; at the end a table gives
every part's outcome, wall time and peak RSS (of the pytest process and its children), and the
exit status is non-zero when any part failed. Arguments that start with `-` go to every
part's pytest; others are paths that narrow the collection
(`python tools/slow_lane.py -x tests/zcore`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_TESTS_COLLECTED = 5  # pytest's exit code when a part's files hold no slow test


def slow_parts(extra: list[str]) -> dict[str, list[str]]:
    """The files holding `slow` tests, grouped by the directory they sit in directly."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "slow", "--collect-only", "-q", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode not in (0, NO_TESTS_COLLECTED):
        sys.stdout.write(out.stdout + out.stderr)
        raise SystemExit(
            f"slow_lane: collecting the slow tests failed (pytest exit {out.returncode})"
        )
    parts: dict[str, set[str]] = defaultdict(set)
    for line in out.stdout.splitlines():
        if "::" in line:
            path = line.split("::", 1)[0]
            parts[str(Path(path).parent)].add(path)
    return {d: sorted(files) for d, files in sorted(parts.items())}


def run_part(files: list[str], extra: list[str]) -> tuple[int, float, float]:
    """One pytest process over `files`: (exit status, wall seconds, peak RSS in GiB)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-m", "slow", "--durations=10", *extra, *files], cwd=ROOT
    )
    _, status, usage = os.wait4(proc.pid, 0)
    # ru_maxrss of wait4 is the largest of the process and the children it waited for, in KiB.
    return os.waitstatus_to_exitcode(status), time.monotonic() - start, usage.ru_maxrss / 2**20


def main(args: list[str]) -> int:
    extra = [a for a in args if a.startswith("-")]
    parts = slow_parts([a for a in args if not a.startswith("-")] + extra)
    total = sum(len(f) for f in parts.values())
    print(f"slow_lane: {total} files in {len(parts)} parts, one pytest process each", flush=True)
    rows = []
    start = time.monotonic()
    for directory, files in parts.items():
        print(f"\n=== slow_lane: {directory} ({len(files)} files)", flush=True)
        code, wall, rss = run_part(files, extra)
        rows.append((directory, code, wall, rss))
    failed = [r for r in rows if r[1] not in (0, NO_TESTS_COLLECTED)]
    print(f"\n{'part':<28} {'exit':>4} {'wall s':>8} {'peak RSS GiB':>12}")
    for directory, code, wall, rss in rows:
        print(f"{directory:<28} {code:>4} {wall:>8.1f} {rss:>12.2f}")
    verdict = f"{len(failed)} of {len(rows)} parts failed" if failed else "every part passed"
    print(f"slow_lane: {verdict} in {time.monotonic() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
