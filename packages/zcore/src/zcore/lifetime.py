"""Tie a rank process's life to the process that started it.

A rank that outlives its launcher (the launcher killed with SIGKILL, by the OOM killer, a
closed terminal or a scheduler's preemption) goes on computing, holding memory and writing
into the run directory, and nothing is left to collect its result. :func:`die_with_parent`
asks the kernel for SIGKILL when the parent dies (``PR_SET_PDEATHSIG``, Linux; elsewhere a
daemon thread polls the parent pid once a second) and exits at once if the parent is
already gone (it may die before the request is made).

SIGKILL cannot be caught: a rank killed mid-save leaves the previous checkpoint intact
(checkpoints are written to a temporary directory and renamed). Linux sends it when the
*thread* that forked the rank ends, so start ranks from a thread that lives as long as the
launcher (its main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 1.0


def die_with_parent(parent: int, what: str = "rank") -> None:
    """End this process with SIGKILL when process ``parent`` (its parent now) ends; exit
    with status 1 at once if it has already ended. ``what`` names this process in that
    exit's message."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    else:
        watch = threading.Thread(target=_watch, args=(parent,), name="parent-watch")
        watch.daemon = True
        watch.start()
    # After the request: a parent that dies from here on kills this process; one that died
    # before has left it with another parent (init or a subreaper).
    if os.getppid() != parent:
        print(
            f"error: launcher (pid {parent}) is gone before {what} started; the {what} exits "
            f"(its parent is now pid {os.getppid()})",
            file=sys.stderr,
        )
        os._exit(1)


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)
