"""Where the streamed layers' blobs live: host memory (``cpu``) or a swap file on disk
read with O_DIRECT through znative's async IO engine (``nvme``).

A store takes each layer's blob once while the model loads (:meth:`put`) and then hands
out fetches into caller buffers (:meth:`fetch`), each a :class:`Fetch` to wait on. The
disk store's reads run on its own engine (io_uring where the kernel allows it, else a
thread pool), so a fetch proceeds while the caller computes; the host store copies on a
thread of its own (torch's copy drops the GIL).
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch

import znative


class OffloadDirError(OSError):
    """The offload directory cannot hold the swap file: missing, read-only or full."""


def aligned_bytes(nbytes: int) -> torch.Tensor:
    """A 4096-aligned uint8 CPU tensor (page-locked when the limit allows it)."""
    return torch.from_numpy(znative.aligned_buffer(nbytes))


class Fetch(Protocol):
    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


class _Future:
    def __init__(self, future: Future[object]) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()


class _Read:
    def __init__(self, store: DiskStore, rid: int, index: int) -> None:
        self._store, self._rid, self._index = store, rid, index

    def wait(self) -> None:
        if self._rid < 0:
            return
        rid, self._rid = self._rid, -1
        try:
            self._store.aio.wait(rid)
        except OSError as err:
            raise OffloadDirError(
                err.errno or errno.EIO,
                f"reading layer {self._index} from `{self._store.path}` failed: {err}",
            ) from err


class Store(Protocol):
    kind: str

    def put(self, index: int, blob: torch.Tensor) -> None: ...
    def fetch(self, index: int, dst: torch.Tensor) -> Fetch: ...
    def host(self, index: int) -> torch.Tensor | None: ...
    def close(self) -> None: ...


class HostStore:
    """Layer blobs in host memory (4096-aligned, page-locked where allowed)."""

    kind = "cpu"

    def __init__(self) -> None:
        self._blobs: dict[int, torch.Tensor] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="zserve-offload-copy")

    def put(self, index: int, blob: torch.Tensor) -> None:
        """Keep ``blob`` (an :func:`aligned_bytes` buffer the store now owns)."""
        self._blobs[index] = blob

    def host(self, index: int) -> torch.Tensor | None:
        """The blob itself: a resident layer computes from it in place."""
        return self._blobs[index]

    def fetch(self, index: int, dst: torch.Tensor) -> Fetch:
        src = self._blobs[index]
        return _Future(self._pool.submit(dst[: src.numel()].copy_, src))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def check_offload_dir(directory: str | os.PathLike[str], nbytes: int) -> Path:
    """``directory`` checked to hold ``nbytes`` of swap: an :class:`OffloadDirError` naming
    the directory, the numbers and the fix if it is missing, not writable or too full."""
    base = Path(directory)
    try:
        is_dir = base.is_dir()
    except PermissionError as err:  # a parent directory this process may not enter
        raise OffloadDirError(
            errno.EACCES,
            f"offload directory `{base}` is not writable (a parent is not accessible: "
            f"{err.strerror}); fix its permissions or pass another `--offload-dir`",
        ) from err
    if not is_dir:
        raise OffloadDirError(
            errno.ENOENT,
            f"offload directory `{base}` does not exist or is not a directory; create it on "
            "a local NVMe drive or pass another `--offload-dir`",
        )
    probe = base / f".zserve-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise OffloadDirError(
            err.errno or errno.EACCES,
            f"offload directory `{base}` is not writable ({err.strerror}); fix its "
            "permissions or pass another `--offload-dir`",
        ) from err
    free = shutil.disk_usage(base).free
    if free < nbytes:
        raise OffloadDirError(
            errno.ENOSPC,
            f"offload directory `{base}` has {free / 2**20:.1f} MiB free; the swap file "
            f"needs {nbytes / 2**20:.1f} MiB; free space or pass another `--offload-dir`",
        )
    return base


class DiskStore:
    """Layer blobs back to back (4096-aligned offsets) in one swap file under ``directory``,
    written while the model loads and read with O_DIRECT; removed on :meth:`close` or
    at exit."""

    kind = "nvme"

    def __init__(
        self, directory: str | os.PathLike[str], nbytes: int, queue_depth: int = 16
    ) -> None:
        base = check_offload_dir(directory, nbytes)
        self.root = base / f"zserve-offload-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.root.mkdir()
        self._remove = weakref.finalize(self, shutil.rmtree, self.root, True)
        self.path = self.root / "layers.swp"
        self.aio = znative.AioHandle(block_size=1 << 20, queue_depth=queue_depth)
        self._offsets: dict[int, tuple[int, int]] = {}
        self._end = 0

    def put(self, index: int, blob: torch.Tensor) -> None:
        n = blob.numel()
        try:
            self.aio.sync_pwrite(blob.numpy(), str(self.path), self._end)
        except OSError as err:
            full = err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
            what = "is full" if full else "failed"
            raise OffloadDirError(
                err.errno or errno.EIO,
                f"writing layer {index} ({n / 2**20:.1f} MiB at offset {self._end}) to "
                f"`{self.path}` {what}: {err}; free space or pass another "
                "`--offload-dir`",
            ) from err
        self._offsets[index] = (self._end, n)
        self._end += n

    def host(self, index: int) -> torch.Tensor | None:
        return None

    def fetch(self, index: int, dst: torch.Tensor) -> Fetch:
        offset, n = self._offsets[index]
        rid = self.aio.pread(dst[:n].numpy(), str(self.path), offset)
        return _Read(self, rid, index)

    def stats(self) -> dict[str, int | str | None]:
        """The engine's counters (requests, bytes, O_DIRECT requests and refusals)."""
        return self.aio.stats()

    def close(self) -> None:
        self.aio.wait()
        self._remove()


def done() -> Fetch:
    """A fetch already complete."""
    return _Done()
