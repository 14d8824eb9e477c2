"""Write a directory all at once: filled beside its destination, fsynced, then renamed in."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from zcore.checkpoint.files import publish_dir


def write_dir_atomically(out_dir: str | os.PathLike[str], fill: Callable[[Path], None]) -> Path:
    """``fill(tmp)`` writes the files into a temporary sibling of ``out_dir``; every file is
    fsynced and the directory renamed into place. An existing ``out_dir`` is moved aside
    first and removed only after the rename, so a crash leaves the old or the new one, never
    a half-written one. Returns the absolute ``out_dir``."""
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        fill(tmp)
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
