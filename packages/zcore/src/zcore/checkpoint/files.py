"""Crash-safe file operations: write to a temporary name, fsync, rename."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch


class CheckpointError(OSError):
    """A checkpoint could not be written or read; the message names the path and the fix."""


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: Path, out: Path) -> None:
    """fsync every file of the filled directory ``tmp`` (a sibling of ``out``) and rename it
    to ``out``. An existing ``out`` is moved aside first and removed only after the rename,
    so a crash leaves the old directory or the new one, never a half-written one."""
    import shutil

    for f in tmp.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(tmp)
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old)


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for the caller to write; publish it on success.

    On a clean exit the temporary file is fsynced, given the mode an ordinary new file
    would get (``0666 & ~umask``), renamed over ``path`` and the directory fsynced, so
    readers see either the old file or the complete new one. On an exception (a full disk,
    a crash in the writer) the temporary file is removed and ``path`` is left as it was.
    Concurrent writers (ranks, threads) each get their own temporary name.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Call ``write`` with a binary file whose content replaces ``path`` atomically.

    See :func:`atomic_path` for the guarantees.
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process umask, read without changing it where Linux reports it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    with _UMASK_LOCK:  # os.umask can only be read by setting it
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def save_torch(obj: Any, path: Path) -> None:
    """``torch.save`` that leaves either the old file or the complete new one."""
    atomic_write(path, lambda f: torch.save(obj, f))


def save_json(obj: Any, path: Path) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=True).encode()))


def save_text(text: str, path: Path) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def load_torch(path: Path) -> Any:
    """Memory-mapped, weights-only load (only the bytes a caller touches are read)."""
    if not path.exists():
        raise CheckpointError(
            f"checkpoint file `{path}` is missing; the checkpoint is incomplete: load another "
            "tag (or save again)"
        )
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # corrupt or truncated file
        raise CheckpointError(
            f"cannot read `{path}` ({err}); the file is truncated or damaged: load another tag "
            "(or save again)"
        ) from err


def load_json(path: Path) -> Any:
    if not path.exists():
        raise CheckpointError(
            f"`{path}` not found; is `{path.parent}` a zstack checkpoint? "
            "(pass the directory given to save_checkpoint, and a tag that exists in it)"
        )
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"cannot read `{path}` ({err}); the file is truncated or damaged: load another tag "
            "(or save again)"
        ) from err
