"""`z COMMAND --nproc N` starting itself again on N local ranks through `z launch`'s torchrun.

Imports only the standard library at load time (the command modules that use it are
imported by `zstack.cli`); the launcher loads when a relaunch runs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def z_script() -> str:
    """The `z` console script to run on every rank (torchrun runs a script file)."""
    here = Path(sys.argv[0])
    if here.name == "z" and here.is_file():
        return str(here)
    beside = Path(sys.executable).with_name("z")
    if beside.is_file():
        return str(beside)
    # the module that defines `z`, found without importing it (it imports the commands)
    spec = importlib.util.find_spec("zstack.cli")
    assert spec is not None and spec.origin is not None
    return spec.origin


def relaunch(script_args: list[str], nproc: int) -> int:
    """Run `z SCRIPT_ARGS` on `nproc` ranks of this machine; the launcher's exit code.

    The cores are divided among the ranks (``OMP_NUM_THREADS``, unless already set): torchrun
    would set 1 thread per rank with a warning.
    """
    from zstack.launch import main as launch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (cores or 1) // nproc)))
    return launch(
        script=z_script(),
        script_args=script_args,
        nproc=nproc,
        nnodes="1",
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=0,  # `--standalone`: a free port
        rdzv_endpoint="",
    )
