"""Crash-safe file operations: write to a temporary name, fsync, rename."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


class CheckpointError(OSError):
    """A checkpoint could not be written or read; the message names the path and the fix."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.part-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def save_torch(obj: Any, path: Path) -> None:
    """``torch.save`` that leaves either the old file or the complete new one."""
    _atomic(path, lambda f: torch.save(obj, f))


def save_json(obj: Any, path: Path) -> None:
    _atomic(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=True).encode()))


def save_text(text: str, path: Path) -> None:
    _atomic(path, lambda f: f.write(text.encode()))


def load_torch(path: Path) -> Any:
    """Memory-mapped, weights-only load (only the bytes a caller touches are read)."""
    if not path.exists():
        raise CheckpointError(f"checkpoint file `{path}` is missing; the checkpoint is incomplete")
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # corrupt or truncated file
        raise CheckpointError(f"cannot read `{path}`: {err}") from err


def load_json(path: Path) -> Any:
    if not path.exists():
        raise CheckpointError(
            f"`{path}` not found; is `{path.parent}` a zstack checkpoint? "
            "(pass the directory given to save_checkpoint, and a tag that exists in it)"
        )
    return json.loads(path.read_text())
