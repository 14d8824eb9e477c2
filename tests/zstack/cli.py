"""Run a `z` command inside the test process (Typer's `CliRunner`), for tests whose subject is
the command's behaviour, not its start-up as a separate program: it skips a fresh interpreter
importing torch for every call. The smoke tests (`test_cli_smoke.py`), `z launch` and rank-death
tests keep real subprocesses."""

from __future__ import annotations

import subprocess

import torch
from typer.testing import CliRunner


def run_z(*args: str) -> subprocess.CompletedProcess[str]:
    """`z ARGS` in this process: its exit code, standard output and standard error.

    torch's thread count is restored afterwards (a command may set its own).
    """
    from zstack.cli import app

    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["z", *args], result.exit_code, result.stdout, result.stderr)
