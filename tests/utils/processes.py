"""Find and watch real processes through `/proc` (Linux): ranks, launchers, their children."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.append(int(entry.name))
    return sorted(found)


def still_alive_after(pids: list[int], seconds: float) -> list[int]:
    """The `pids` still alive once `seconds` have passed (or none are left); each one left is
    then killed (SIGKILL), so a failing test leaves no process of its own behind."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left
