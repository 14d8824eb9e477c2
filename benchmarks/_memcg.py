"""A memory cgroup made, used and removed by one benchmark run (a helper module, loaded
with ``zcore.bench.load("_memcg", Path(__file__).parent)``).

:func:`make` creates ``zstack-bench-<pid>`` under this process's own memory cgroup (cgroup v1's
``memory`` hierarchy, or v2's unified one where ``memory`` is enabled for children), so every
limit above it still applies and nothing outside this run's subtree is touched. A process
joins with :func:`join` (its pid into ``cgroup.procs``) after setting the limit with
:func:`set_limit`; :func:`stats` reads the peak usage and how often the limit was hit, and
:func:`remove` deletes the group once its processes have exited. Everything a process touches
while in the group is charged to it, including the page cache of the files it reads or maps:
so a ``mmap``ed model larger than the limit is read again from disk as the kernel reclaims it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

V1_ROOT = Path("/sys/fs/cgroup/memory")


def _own_group() -> tuple[Path, int] | tuple[None, str]:
    """(this process's memory cgroup directory, cgroup version), or (None, why not)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and V1_ROOT.is_dir():
            return V1_ROOT / path.lstrip("/"), 1
    for line in lines:
        if line.startswith("0::"):
            for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
                here = root / line[3:].lstrip("/")
                control = here / "cgroup.subtree_control"
                if control.is_file() and "memory" in control.read_text().split():
                    return here, 2
    return None, "no memory cgroup controller is available to this process (/proc/self/cgroup)"


def make(tag: str = "") -> tuple[Path | None, str]:
    """A new, empty memory cgroup under this process's own: (its directory, "") or (None,
    why it could not be made)."""
    parent, version = _own_group()
    if parent is None:
        return None, str(version)
    group = parent / f"zstack-bench-{os.getpid()}{tag}"
    try:
        group.mkdir()
    except OSError as err:
        return None, f"cannot create a memory cgroup under `{parent}`: {err}"
    return group, ""


def set_limit(group: Path, limit: int) -> None:
    """The group's memory limit, bytes (v1 ``memory.limit_in_bytes``, v2 ``memory.max``)."""
    v1 = group / "memory.limit_in_bytes"
    (v1 if v1.exists() else group / "memory.max").write_text(str(int(limit)))


def join(group: Path, pid: int | None = None) -> None:
    """Move ``pid`` (default: this process) into the group."""
    (group / "cgroup.procs").write_text(str(pid or os.getpid()))


def stats(group: Path) -> dict[str, Any]:
    """The limit, the peak usage and the times the limit was hit (as the kernel counts)."""

    def read(name: str) -> int | None:
        try:
            text = (group / name).read_text().split()[0]
        except (OSError, IndexError):
            return None
        return int(text) if text.isdigit() else None

    if (group / "memory.limit_in_bytes").exists():
        return {
            "limit_bytes": read("memory.limit_in_bytes"),
            "peak_bytes": read("memory.max_usage_in_bytes"),
            "limit_hits": read("memory.failcnt"),
        }
    events = {}
    if (group / "memory.events").exists():
        for line in (group / "memory.events").read_text().splitlines():
            key, value = line.split()
            events[key] = int(value)
    return {
        "limit_bytes": read("memory.max"),
        "peak_bytes": read("memory.peak"),
        "limit_hits": events.get("max"),
    }


def remove(group: Path, wait_s: float = 5.0) -> None:
    """Delete the group (waiting up to ``wait_s`` for exiting processes to leave it)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
