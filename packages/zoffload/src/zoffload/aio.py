"""Async file IO for ZeRO-Infinity: CPU torch tensors to and from files through
the native engine (:class:`znative.AioHandle`), in the spirit of DeepSpeed's
``aio_handle``.

A tensor crosses as its bytes (any dtype, viewed as uint8; a slice of a larger
tensor works), never copied. The engine uses io_uring where it works (else a
pool of threads), O_DIRECT for the 4096-aligned middle of each request and the
page cache for an unaligned head or tail. A tensor whose data address is not
4096-aligned still works but is bounced through an aligned buffer one block at
a time; allocate with :func:`new_aligned_tensor` to avoid that. A write's
``wait`` returns only after the data is written in full and ``fdatasync``
returned. Failures raise :class:`znative.AioError` (an ``OSError`` with
``errno``, ``path`` and ``offset``); a missing file is also a
``FileNotFoundError``, a refused one a ``PermissionError``, and reading past
the end of a file an :class:`znative.AioShortReadError`, never zero-filled.

Example::

    handle = AioHandle(AioConfig(queue_depth=32))
    buf = new_aligned_tensor(1 << 20, torch.float32)
    req = handle.async_pwrite(buf, "/nvme/swap/p0.bin")
    ...                      # overlap compute with the write
    req.wait()
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

import znative
from zcore.config.aio import ALIGNMENT, AioConfig
from znative import AioError, AioShortReadError

__all__ = [
    "ALIGNMENT",
    "AioConfig",
    "AioError",
    "AioHandle",
    "AioRequest",
    "AioShortReadError",
    "new_aligned_tensor",
]

Path = str | os.PathLike[str]


def _bytes_of(tensor: torch.Tensor, name: str = "tensor") -> Any:
    """The tensor's memory as a uint8 numpy array (no copy)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{name} is on {tensor.device}; file IO needs a CPU tensor "
            "(stage it through `new_aligned_tensor(...)` and `.copy_()`)"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{name} (shape {tuple(tensor.shape)}, strides {tensor.stride()}) is not contiguous; "
            "IO moves one byte range, so pass `.contiguous()`"
        )
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8).numpy()
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def new_aligned_tensor(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero-filled 1-D CPU tensor of ``numel`` elements over a 4096-aligned
    allocation, page-locked when RLIMIT_MEMLOCK allows it (best effort, never
    fails for that; ``znative.aligned_buffer(n).base.locked`` reports it for a
    raw buffer). O_DIRECT reads and writes it without a bounce copy."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = znative.aligned_buffer(numel * itemsize)
    return torch.from_numpy(raw).view(dtype)


class AioRequest:
    """One submitted read or write; :meth:`wait` blocks until it is done and
    returns the bytes moved, or raises its error (again on every call)."""

    def __init__(self, handle: AioHandle, rid: int, tensor: torch.Tensor, path: Path, op: str):
        self._handle, self.id, self.tensor, self.path, self.op = handle, rid, tensor, path, op
        self._result: int | None = None
        self._error: BaseException | None = None
        self._settled = threading.Event()  # set once the result or error is stored

    @property
    def done(self) -> bool:
        """Whether the result has been collected (by :meth:`wait` or the handle's ``wait``)."""
        return self._result is not None or self._error is not None

    def wait(self) -> int:
        if not self.done:
            self._handle._collect(self)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.done else "pending"
        return f"AioRequest({self.op} {os.fspath(self.path)!r}, id={self.id}, {state})"


class AioHandle:
    """Async reads and writes of CPU tensors at file offsets (see module docs).

    Many requests may be in flight on many files; each keeps its tensor alive
    until waited on. All blocking work releases the GIL.
    """

    def __init__(self, config: AioConfig | dict[str, Any] | None = None):
        self.config = config if isinstance(config, AioConfig) else AioConfig(**(config or {}))
        c = self.config
        self._native = znative.AioHandle(
            block_size=c.block_size,
            queue_depth=c.queue_depth,
            intra_op_parallelism=c.intra_op_parallelism,
            single_submit=c.single_submit,
            overlap_events=c.overlap_events,
            backend=c.backend,
        )
        self._pending: dict[int, AioRequest] = {}
        self._lock = threading.Lock()

    @property
    def backend(self) -> str:
        """``io_uring`` or ``threads``."""
        return self._native.backend

    @property
    def backend_reason(self) -> str:
        """``requested``, or what ``auto`` found (e.g. why io_uring_setup failed)."""
        return self._native.backend_reason

    def stats(self) -> dict[str, int | str | None]:
        """Requests, bytes, O_DIRECT requests, O_DIRECT refusals (with the last reason),
        bounced (misaligned) requests."""
        return self._native.stats()

    def _submit(self, op: str, tensor: torch.Tensor, path: Path, offset: int) -> AioRequest:
        buf = _bytes_of(tensor)
        fn = self._native.pread if op == "read" else self._native.pwrite
        rid = fn(buf, path, offset)
        req = AioRequest(self, rid, tensor, path, op)
        with self._lock:
            self._pending[rid] = req
        return req

    def async_pread(self, tensor: torch.Tensor, path: Path, offset: int = 0) -> AioRequest:
        """Starts filling ``tensor`` with its ``nbytes`` bytes at ``offset`` of ``path``.
        A missing or unreadable file raises here; IO errors raise from ``wait``."""
        return self._submit("read", tensor, path, offset)

    def async_pwrite(self, tensor: torch.Tensor, path: Path, offset: int = 0) -> AioRequest:
        """Starts writing ``tensor``'s bytes at ``offset`` of ``path`` (created if
        missing, never truncated). Do not modify the tensor until ``wait`` returns."""
        return self._submit("write", tensor, path, offset)

    def sync_pread(self, tensor: torch.Tensor, path: Path, offset: int = 0) -> int:
        """Reads into ``tensor`` and returns the bytes read."""
        return self._native.sync_pread(_bytes_of(tensor), path, offset)

    def sync_pwrite(self, tensor: torch.Tensor, path: Path, offset: int = 0) -> int:
        """Writes ``tensor`` and returns once it is durable (``fdatasync``)."""
        return self._native.sync_pwrite(_bytes_of(tensor), path, offset)

    def _collect(self, req: AioRequest) -> None:
        with self._lock:
            mine = self._pending.pop(req.id, None) is not None
        if not mine:  # another thread's wait() is collecting it: wait for its outcome
            req._settled.wait()
            return
        try:
            req._result = self._native.wait(req.id)
        except BaseException as e:
            req._error = e
        finally:
            req._settled.set()

    def wait(self) -> int:
        """Waits for every pending request; total bytes. Raises the first error
        only after all have finished (each request keeps its own result)."""
        with self._lock:
            reqs = list(self._pending.values())
        for r in reqs:
            if not r.done:
                self._collect(r)
        first = next((r._error for r in reqs if r._error is not None), None)
        if first is not None:
            raise first
        return sum(r._result or 0 for r in reqs)

    @property
    def pending(self) -> int:
        """Requests submitted and not yet waited on."""
        with self._lock:
            return len(self._pending)
