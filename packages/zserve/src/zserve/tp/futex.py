"""Waiting on a word of shared memory across processes (Linux futexes), and the host facts a
waiting rank of :mod:`zserve.tp.shm` decides by: whether a peer's process still runs, and
whether this host's CPUs are oversubscribed (then a waiter sleeps at once instead of
spinning on a core another process needs)."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Any

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared between processes: not FUTEX_PRIVATE_FLAG


class Timespec(ctypes.Structure):
    """A ``struct timespec``: a futex wait's longest sleep."""

    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


syscall: Any
try:  # libc's syscall(), which releases the GIL while it sleeps; Linux only
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long
except (OSError, AttributeError, TypeError):  # no libc to load (not a POSIX host)
    syscall = None


def futex_wait(addr: int, seen: int, nap: Timespec) -> None:
    """Sleep until woken on the 32-bit word at ``addr`` (the low half of a flag), unless it
    no longer holds ``seen``'s low half, for at most ``nap``."""
    low = seen & 0xFFFFFFFF
    low = low - (1 << 32) if low >= 1 << 31 else low
    syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(addr),
        ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_int(low),
        ctypes.byref(nap),
        None,
        ctypes.c_int(0),
    )


def futex_wake(addr: int) -> None:
    """Wake every process sleeping on the word at ``addr``."""
    syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(addr),
        ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(2**31 - 1),
        None,
        None,
        ctypes.c_int(0),
    )


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


CROWDED_CHECK_S = 1.0
"""How often :func:`cpus_crowded` looks at the host again."""
_crowded = {"at": 0.0, "value": True}


def cpus_crowded() -> bool:
    """Whether runnable tasks wait for this host's CPUs (looked up at most every
    :data:`CROWDED_CHECK_S`): Linux's CPU pressure, 10 s average above 10%, or where that is
    not readable, a 1-minute load average above the usable cores plus one half."""
    now = time.monotonic()
    if now < _crowded["at"]:
        return bool(_crowded["value"])
    try:
        some = Path("/proc/pressure/cpu").read_text().split("\n", 1)[0]
        crowded = float(some.split("avg10=", 1)[1].split()[0]) > 10.0
    except (OSError, IndexError, ValueError):
        try:
            crowded = os.getloadavg()[0] > len(os.sched_getaffinity(0)) + 0.5
        except (OSError, AttributeError):
            crowded = True
    _crowded["at"], _crowded["value"] = now + CROWDED_CHECK_S, crowded
    return crowded
