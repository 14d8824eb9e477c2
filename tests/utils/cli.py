"""The `z` command line run as a user runs it, in a child process.

Tests outside `tests/zstack` check a library through `z` this way: they may not import the
CLI package (`tests/test_layout.py`), and a child process runs the console script the user
has, not an in-process copy of its Typer app.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

Z = Path(sys.executable).with_name("z")
"""The `z` console script of this environment."""


def run_z(*args: str, ok: bool = True, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """`z ARGS...` with this process's environment; stdout and stderr as text. With `ok`
    (the default) the exit status must be 0, else the assertion shows the command's output."""
    done = subprocess.run(
        [str(Z), *args], capture_output=True, text=True, timeout=timeout, env=os.environ
    )
    if ok:
        assert done.returncode == 0, (
            f"`z {' '.join(args)}` exited {done.returncode}:\n{done.stdout[-3000:]}"
            f"{done.stderr[-3000:]}"
        )
    return done
