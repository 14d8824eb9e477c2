"""One rank's swap space on NVMe: named flat files read and written in tiles.

Every file is a flat array of one dtype under a directory of its own
(``<nvme_path>/zoffload-<pid>-<id>/rank<r>/``), created at start and removed when the
engine is destroyed or the process exits. Reads and writes go through the native async-IO
engine (:mod:`zoffload.aio`: io_uring or a thread pool, ``O_DIRECT``) into caller
buffers; they are issued, then waited on, so the next tile's read and the previous tile's
write overlap the current tile's compute.

What was written is checked when it is read back: every tile's CRC-32 is kept in memory
when it is written and compared after the read, and a short file fails the read, so a
truncated or corrupted swap file is detected and never trained on. (Data read back in
other pieces than it was written in, such as gradient slots read as tiles, is written
with ``check=False`` and checked by its owner with :func:`crc32` and :meth:`SwapSpace.corrupt`.)
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
import weakref
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from zcore.sequence.heap import fix_mmap_threshold
from zoffload.aio import AioHandle


def return_freed_memory() -> bool:
    """Make glibc give large freed blocks back to the OS at once (fixed 128 KiB mmap
    threshold), so host memory of a swapping run stays at what is live.

    glibc raises its mmap threshold after each large free (up to 32 MiB), after which
    shard- and tile-sized temporaries come from the heap and freed ones stay resident:
    measured here, a 100M-parameter model under ``zero.Init`` left ~410 MB resident that
    way. Returns whether the setting took (False off glibc). The setting is
    :func:`zcore.sequence.heap.fix_mmap_threshold`'s, which ALST tiling makes too.
    """
    return fix_mmap_threshold()


class SwapError(OSError):
    """A swap file could not be written or read back intact; names the file and the fix."""


def wait_all(ios: Iterable[SwapIO]) -> SwapError | None:
    """Wait for every one of ``ios``, even after one fails (their buffers are reused
    next); the first failure, if any."""
    first: SwapError | None = None
    for io in ios:
        try:
            io.wait()
        except SwapError as err:
            first = first or err
    return first


class SwapIO:
    """An issued tile read or write; :meth:`wait` finishes it (and checks a read)."""

    def __init__(
        self, space: SwapSpace, handle: Any, key: tuple[str, int], buf: torch.Tensor, read: bool
    ) -> None:
        self._space, self._handle, self._key, self._buf, self._read = space, handle, key, buf, read

    def wait(self) -> None:
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        name, offset = self._key
        path = self._space.path(name)
        try:
            handle.wait()
        except OSError as err:
            raise self._space.error(path, offset * self._buf.element_size(), err) from err
        if self._read:
            self._space.verify(self._key, self._buf)


class SwapSpace:
    """Named flat swap files of one rank under ``root``."""

    def __init__(self, root: Path, aio: AioHandle) -> None:
        self.root = root
        self.aio = aio
        self._crc: dict[tuple[str, int], tuple[int, int]] = {}
        # Removes the directory on close(), when the space is collected, or at exit, whichever
        # comes first; unlike a bound method per instance in atexit, it does not keep the space
        # (and its checksum table) alive until the process ends.
        self._remove = weakref.finalize(self, _remove_dir, root)

    @classmethod
    def create(cls, nvme_path: str | os.PathLike[str], rank: int, aio: AioHandle) -> SwapSpace:
        """A fresh swap directory under ``nvme_path`` (which must exist and be writable)."""
        base = Path(nvme_path)
        what = "offload nvme_path"
        if not base.is_dir():
            raise SwapError(
                errno.ENOENT,
                f"{what} `{base}` does not exist or is not a directory; create it on a local "
                "NVMe drive or point nvme_path at one",
            )
        if not os.access(base, os.W_OK | os.X_OK):
            raise SwapError(
                errno.EACCES,
                f"{what} `{base}` is not writable by this process; fix its permissions or "
                "choose another nvme_path",
            )
        return_freed_memory()
        root = base / f"zoffload-{os.getpid()}-{uuid.uuid4().hex[:8]}" / f"rank{rank}"
        try:
            root.mkdir(parents=True)
        except OSError as err:
            raise SwapError(err.errno, f"cannot create swap directory `{root}`: {err}") from err
        return cls(root, aio)

    def path(self, name: str) -> Path:
        return self.root / f"{name}.swp"

    def write(self, name: str, buf: torch.Tensor, offset: int, check: bool = True) -> SwapIO:
        """Write ``buf`` (flat) at element ``offset`` of file ``name``; ``buf`` must stay
        untouched until the returned write is waited on. ``check=False``: no checksum (for
        data read back in other pieces than written, such as gradient slots read as tiles;
        such data lives one step and a short file still fails its read)."""
        key = (name, offset)
        if check:
            self._crc[key] = (buf.numel(), crc32(buf))
        try:
            handle = self.aio.async_pwrite(buf, str(self.path(name)), offset * buf.element_size())
        except OSError as err:
            raise self.error(self.path(name), offset * buf.element_size(), err) from err
        return SwapIO(self, handle, key, buf, read=False)

    def read(self, name: str, buf: torch.Tensor, offset: int, check: bool = True) -> SwapIO:
        """Read ``buf.numel()`` elements at element ``offset`` of file ``name`` into ``buf``
        (``check=False``: data written without a checksum)."""
        key = (name, offset)
        if check and key not in self._crc:
            raise SwapError(
                errno.ENOENT,
                f"swap file `{self.path(name)}` has no tile at element {offset} (never written)",
            )
        try:
            handle = self.aio.async_pread(buf, str(self.path(name)), offset * buf.element_size())
        except OSError as err:
            raise self.error(self.path(name), offset * buf.element_size(), err) from err
        return SwapIO(self, handle, key, buf, read=check)

    def verify(self, key: tuple[str, int], buf: torch.Tensor) -> None:
        numel, crc = self._crc[key]
        if buf.numel() != numel or crc32(buf) != crc:
            raise self.corrupt(key[0], key[1], numel)

    def corrupt(self, name: str, offset: int, numel: int, what: str = "the tile") -> SwapError:
        """The error for data of file ``name`` that does not read back as it was written."""
        return SwapError(
            errno.EIO,
            f"swap file `{self.path(name)}` is corrupt: {what} at element {offset} "
            f"({numel} elements) does not read back as written; the drive or another "
            "process changed it. Training stopped before using it: restart from the last "
            "checkpoint",
        )

    def error(self, path: Path, offset: int, err: OSError) -> SwapError:
        code = err.errno or errno.EIO
        if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            fix = "free space on that drive, or point nvme_path at a larger one"
        elif code in (errno.ENOENT,):
            fix = "the swap file was removed while training; restart from the last checkpoint"
        else:
            fix = "check the drive (dmesg) and restart from the last checkpoint"
        return SwapError(code, f"swap IO on `{path}` at byte {offset} failed: {err}; {fix}")

    def bytes_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("*.swp"))

    def close(self) -> None:
        """Remove the swap directory (and its per-job parent when empty)."""
        self._remove()


def _remove_dir(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    try:
        root.parent.rmdir()
    except OSError:
        pass


def crc32(t: torch.Tensor, value: int = 0) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes, continuing from ``value`` (the CRC of
    what comes before it), as :func:`zlib.crc32`."""
    return zlib.crc32(_bytes(t), value)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().view(torch.uint8).numpy())
