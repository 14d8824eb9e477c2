"""One live run per run directory: `OUT/.lock`, held by the process that starts the run.

Two runs on one directory would interleave their checkpoints and `latest` pointer and
rewrite each other's `metrics.jsonl`. The process that starts a run (the launcher of a
multi-rank run, the only process of a one-rank run) takes an exclusive `flock` on
`OUT/.lock` for the whole run and writes its pid and host into it, so a second `z train`
on the directory fails at start naming the holder. The kernel drops the lock when the
holder's last descriptor closes, however it ends (`kill -9` included): a lock left by a
dead run never blocks the next one. `flock` is local to a host on most network file
systems; the host in the file says where a holder runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ztrain.train_options import TrainError

LOCK_NAME = ".lock"


def _holder(path: Path) -> str:
    """Who holds the lock in `path`, as its holder wrote it."""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        return f"pid {info['pid']} on host {info['host']} (since {info['since']})"
    except (OSError, ValueError, KeyError, TypeError):  # it has locked but not yet written
        return "a process that is just starting"


@contextmanager
def hold_run_dir(out: Path) -> Iterator[Path]:
    """Hold `out` (created if missing) for the duration; yields the lock file's path.

    Raises TrainError naming the holder's pid and host when a live run holds it.
    """
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TrainError(
                f"run directory `{out}` is in use by {_holder(path)}, which holds `{path}`; "
                f"wait for that run to end or stop it, or pass another `--out`"
            ) from None
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "since": since}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(mine) + "\n").encode(), 0)
        yield path
    finally:
        os.close(fd)  # drops the lock
