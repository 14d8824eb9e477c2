"""File IO throughput for NVMe offload: zoffload's async IO engine (io_uring
and thread backends, O_DIRECT, aligned buffers) against plain Python
``write``+``fsync`` / cold ``readinto``, ``torch.save``/``torch.load``, and
DeepSpeed's ``aio_handle`` when ``deepspeed`` imports and its AsyncIO op builds.

Every contender writes the same random bytes to a fresh file in ``--dir`` and
reads them back into memory; the bytes read are compared with the bytes
written. Writes are timed until durable (ours: ``fdatasync`` inside ``wait``;
Python and torch: ``fsync``; DeepSpeed: its O_DIRECT write, then ``fdatasync``,
with the unsynced time reported too). The O_DIRECT contenders (ours, DeepSpeed)
also time a second write over the full-size file in place (``rewrite``), as a
swap file is rewritten every step: on ext4 an O_DIRECT write past the end of a
file completes inside the submit call, which serializes libaio's queue (DeepSpeed
on a fresh file) but not in-place writes. Every read starts cold: ours and
DeepSpeed's read with ``O_DIRECT``; before the buffered ones (Python, torch)
the file is synced and dropped from the page cache (``posix_fadvise(DONTNEED)``),
and ``mincore`` confirms no page of it stayed. Each result says how it read
(``read_mode``) and how many bytes were cached when its read began. The
contenders run in interleaved rounds on the same file system; medians are
reported.

Run: ``z bench io --size 1GiB --dir D --block-size 1MiB --queue-depth 128 --json``.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import znative
from zoffload.aio import AioConfig, AioHandle, new_aligned_tensor

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6}
_UNITS |= {"mib": 1 << 20, "g": 1e9, "gb": 1e9, "gib": 1 << 30}


def parse_size(text: str | int, flag: str = "--size") -> int:
    """``"1GiB"`` → 1073741824; also ``MiB``, ``KiB``, ``GB``, ``MB``, plain bytes; a
    ValueError naming ``flag`` otherwise."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{flag} {text!r}: expected a number with an optional unit like 1GiB, 64MiB"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache now: ``mincore`` over a fresh read-only mapping
    (mapping faults nothing in, so looking does not warm the file)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr == _MAP_FAILED:
            e = ctypes.get_errno()
            raise OSError(e, f"mmap of {path} to check its page cache: {os.strerror(e)}")
        try:
            vec = ctypes.create_string_buffer((size + page - 1) // page)
            if _libc.mincore(addr, size, vec) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"mincore on {path}: {os.strerror(e)}")
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    pages = sum(b & 1 for b in vec.raw)
    return min(pages * page, size)


def drop_cache(path: Path, tries: int = 3) -> int:
    """Make ``path`` cold: write back its dirty pages (``fdatasync``), then drop them
    (``posix_fadvise(DONTNEED)``), again while any stay. Returns the bytes still cached:
    0 on a disk file system; more where the kernel keeps pages (tmpfs, a page mapped or
    pinned elsewhere)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        for _ in range(tries):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            left = resident_bytes(path)
            if left == 0:
                break
    finally:
        os.close(fd)
    return left


def _fs_of(path: Path) -> str:
    """The file system type and device holding ``path`` (longest mount prefix)."""
    best = ("", "?", "?")
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if str(path).startswith(mnt) and len(mnt) > len(best[0]):
                best = (mnt, fstype, dev)
    return f"{best[1]} on {best[2]} (mounted at {best[0]})"


# How a buffered path reads: from disk, because every read starts with the file dropped.
_BUFFERED_COLD = "buffered, cold (fdatasync + posix_fadvise DONTNEED)"


class _Ours:
    def __init__(self, backend: str, cfg: AioConfig, dst: torch.Tensor):
        self.h = AioHandle(cfg.model_copy(update={"backend": backend}))
        self.dst = dst
        self.o_direct = True
        self.read_mode = "O_DIRECT"

    def write(self, src: torch.Tensor, path: Path) -> None:
        self.h.async_pwrite(src, path).wait()

    def read(self, path: Path) -> torch.Tensor:
        self.h.async_pread(self.dst, path).wait()
        return self.dst


class _Python:
    o_direct = False
    read_mode = _BUFFERED_COLD

    def __init__(self, dst: torch.Tensor):
        self.dst = dst

    def write(self, src: torch.Tensor, path: Path) -> None:
        with open(path, "wb", buffering=0) as f:
            f.write(memoryview(src.numpy()))
            os.fsync(f.fileno())

    def read(self, path: Path) -> torch.Tensor:
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(self.dst.numpy()))
        return self.dst


class _Torch:
    o_direct = False
    read_mode = _BUFFERED_COLD
    dst = None  # torch.load allocates what it returns

    def write(self, src: torch.Tensor, path: Path) -> None:
        with open(path, "wb") as f:
            torch.save(src, f)
            f.flush()
            os.fsync(f.fileno())

    def read(self, path: Path) -> torch.Tensor:
        return torch.load(path, weights_only=True)


class _DeepSpeed:
    o_direct = True
    read_mode = "O_DIRECT"

    def __init__(self, handle: Any, src: torch.Tensor):
        # Its own page-locked buffers, as DeepSpeed's swapper allocates them: given any other
        # CPU tensor, every op would allocate, mlock and copy through a bounce buffer of the
        # whole size (0.19.8's cpu_op_desc_t), which measures that rather than its IO.
        self.h = handle
        self.src = handle.new_cpu_locked_tensor(src.numel(), src)
        self.src.copy_(src)
        self.dst = handle.new_cpu_locked_tensor(src.numel(), src)
        self.unsynced_write_s: list[float] = []  # fresh-file writes only
        self.last_unsynced_s = 0.0

    def close(self) -> None:
        self.h.free_cpu_locked_tensor(self.src)
        self.h.free_cpu_locked_tensor(self.dst)

    def write(self, src: torch.Tensor, path: Path) -> None:
        t0 = time.perf_counter()
        self.h.sync_pwrite(self.src, str(path))  # the same bytes as src
        self.last_unsynced_s = time.perf_counter() - t0
        fd = os.open(path, os.O_RDONLY)  # its O_DIRECT write is not synced: sync it like ours
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def read(self, path: Path) -> torch.Tensor:
        self.h.sync_pread(self.dst, str(path))
        return self.dst


def _deepspeed_handle(cfg: AioConfig) -> tuple[Any | None, str]:
    """DeepSpeed's aio_handle if deepspeed imports and its AsyncIO op builds (never a dependency)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore[import-not-found]
    except Exception as e:
        return None, f"not importable: {type(e).__name__}: {e}".splitlines()[0][:200]
    try:
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None, "AsyncIOBuilder is not compatible here (libaio-dev missing?)"
        op = builder.load(verbose=False)
        handle = op.aio_handle(
            cfg.block_size,
            cfg.queue_depth,
            cfg.single_submit,
            cfg.overlap_events,
            cfg.intra_op_parallelism,
        )
    except Exception as e:
        return None, f"failed to build: {type(e).__name__}: {e}".splitlines()[0][:200]
    return handle, "ok"


def _read_mode(mode: str, cached: int, nbytes: int) -> str:
    """``mode``, or, for a buffered path whose file kept pages in the cache, what it really
    was (O_DIRECT bypasses the cache, so pages left there do not help it)."""
    if cached == 0 or mode == "O_DIRECT":
        return mode
    return (
        f"buffered, NOT cold: {cached} of {nbytes} bytes stayed cached after "
        f"posix_fadvise(DONTNEED) (tmpfs? pick a disk with --dir)"
    )


def run(
    size: str | int = "1GiB",
    dir: str | None = None,
    block_size: str | int = "1MiB",
    queue_depth: int = 128,
    intra_op_parallelism: int = 1,
    rounds: int = 3,
    deepspeed: bool = True,
) -> dict[str, Any]:
    """Time every contender; returns the JSON-able result."""
    nbytes, block = parse_size(size), parse_size(block_size, "--block-size")
    if nbytes < 4096 or rounds < 1:
        raise ValueError(f"need size >= 4096 bytes and rounds >= 1 (got {nbytes}, {rounds})")
    cfg = AioConfig(
        block_size=block, queue_depth=queue_depth, intra_op_parallelism=intra_op_parallelism
    )
    base = Path(dir) if dir else Path(tempfile.gettempdir())
    if not base.is_dir():
        raise FileNotFoundError(f"--dir {base} is not a directory; create it or pick another")
    work = Path(tempfile.mkdtemp(prefix="zstack-bench-io-", dir=base))

    src = new_aligned_tensor(nbytes, torch.uint8)
    g = torch.Generator().manual_seed(0)
    words = nbytes // 8
    src[: words * 8].view(torch.int64).copy_(
        torch.randint(-(2**63), 2**63 - 1, (words,), dtype=torch.int64, generator=g)
    )
    src[words * 8 :] = 0xA5
    dst = new_aligned_tensor(nbytes, torch.uint8)

    probe = znative.io_backend_probe()
    contenders: dict[str, Any] = {}
    contenders["zstack_threads"] = _Ours("threads", cfg, dst)
    if probe[0] == "io_uring":
        contenders["zstack_io_uring"] = _Ours("io_uring", cfg, dst)
    contenders["python_write_fsync_readinto"] = _Python(dst)
    contenders["torch_save_load"] = _Torch()
    ds_status = "skipped (--no-ds)"
    if deepspeed:
        ds_handle, ds_status = _deepspeed_handle(cfg)
        if ds_handle is not None:
            contenders["deepspeed_aio"] = _DeepSpeed(ds_handle, src)

    times: dict[str, dict[str, list[float]]] = {
        n: {"write": [], "read": [], "rewrite": []} for n in contenders
    }
    verified = dict.fromkeys(contenders, True)
    cached = dict.fromkeys(contenders, 0)  # most bytes in the page cache when a read began
    try:
        for _ in range(rounds):
            for name, c in contenders.items():
                path = work / f"{name}.bin"
                t0 = time.perf_counter()
                c.write(src, path)
                times[name]["write"].append(time.perf_counter() - t0)
                if isinstance(c, _DeepSpeed):
                    c.unsynced_write_s.append(c.last_unsynced_s)
                cached[name] = max(cached[name], drop_cache(path))
                if c.dst is not None:
                    c.dst.zero_()
                t0 = time.perf_counter()
                out = c.read(path)
                times[name]["read"].append(time.perf_counter() - t0)
                verified[name] &= bool(torch.equal(out, src))
                if c.o_direct:  # in place, as a swap file is rewritten every step
                    t0 = time.perf_counter()
                    c.write(src, path)
                    times[name]["rewrite"].append(time.perf_counter() - t0)
                path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for c in contenders.values():
            if isinstance(c, _DeepSpeed):
                c.close()

    results: dict[str, dict[str, Any]] = {}
    for name, c in contenders.items():
        w, r = statistics.median(times[name]["write"]), statistics.median(times[name]["read"])
        results[name] = {
            "write_median_s": w,
            "read_median_s": r,
            "write_gb_per_s": nbytes / w / 1e9,
            "read_gb_per_s": nbytes / r / 1e9,
            "o_direct": c.o_direct,
            "read_mode": _read_mode(c.read_mode, cached[name], nbytes),
            "cached_bytes_at_read": cached[name],
            "verified": verified[name],
        }
        if times[name]["rewrite"]:
            rw = statistics.median(times[name]["rewrite"])
            results[name]["rewrite_median_s"] = rw
            results[name]["rewrite_gb_per_s"] = nbytes / rw / 1e9
        if isinstance(c, _DeepSpeed):
            unsynced = statistics.median(c.unsynced_write_s)
            results[name]["write_unsynced_median_s"] = unsynced
            results[name]["write_unsynced_gb_per_s"] = nbytes / unsynced / 1e9
            results[name]["buffers"] = "page-locked (aio_handle.new_cpu_locked_tensor)"
        if isinstance(c, _Ours):
            results[name]["stats"] = c.h.stats()
    ours_name = "zstack_io_uring" if "zstack_io_uring" in results else "zstack_threads"
    ours = results[ours_name]
    speedup = {
        f"vs_{n}": {
            "write": r["write_median_s"] / ours["write_median_s"],
            "read": r["read_median_s"] / ours["read_median_s"],
        }
        for n, r in results.items()
        if n != ours_name
    }
    ds = results.get("deepspeed_aio")
    return {
        "benchmark": "io",
        "size_bytes": nbytes,
        "block_size": block,
        "queue_depth": queue_depth,
        "intra_op_parallelism": intra_op_parallelism,
        "rounds": rounds,
        # every contender's read-back equal to what it wrote (z bench exits 1 otherwise)
        "ok": all(r["verified"] for r in results.values()),
        "dir": str(base),
        "filesystem": _fs_of(base.resolve()),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores_usable": len(os.sched_getaffinity(0)),
            "kernel": platform.release(),
            "torch": torch.__version__,
        },
        "io_backend_probe": {"name": probe[0], "reason": probe[1]},
        "ours": ours_name,
        "results": results,
        "speedup_of_ours": speedup,
        "ratio_ours_over_deepspeed_gb_per_s": None
        if ds is None
        else {
            "write": ours["write_gb_per_s"] / ds["write_gb_per_s"],
            "read": ours["read_gb_per_s"] / ds["read_gb_per_s"],
            "rewrite": ours["rewrite_gb_per_s"] / ds["rewrite_gb_per_s"],
        },
        "deepspeed_aio": ds_status,
    }


def report(result: dict[str, Any]) -> str:
    """A table a person can read; the JSON follows it."""
    lines = [
        f"file io, {result['size_bytes'] / 2**20:.0f} MiB, block {result['block_size']}, "
        f"queue depth {result['queue_depth']}, {result['rounds']} rounds, {result['filesystem']}",
        f"{'contender':<30} {'write GB/s':>10} {'rewrite':>8} {'read GB/s':>10}  verified  "
        "read mode",
    ]
    for name, r in result["results"].items():
        rw = f"{r['rewrite_gb_per_s']:8.3f}" if "rewrite_gb_per_s" in r else f"{'-':>8}"
        lines.append(
            f"{name:<30} {r['write_gb_per_s']:10.3f} {rw} {r['read_gb_per_s']:10.3f}  "
            f"{r['verified']!s:<8}  {r['read_mode']}"
        )
    ratio = result["ratio_ours_over_deepspeed_gb_per_s"]
    if ratio:
        lines.append(
            f"{result['ours']} / deepspeed_aio: write {ratio['write']:.2f}x, "
            f"read {ratio['read']:.2f}x, rewrite in place {ratio['rewrite']:.2f}x"
        )
    lines.append(f"deepspeed_aio: {result['deepspeed_aio']}")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--block-size", default="1MiB")
    ap.add_argument("--queue-depth", type=int, default=128)
    ap.add_argument("--intra-op-parallelism", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-ds", action="store_true")
    ns = ap.parse_args()
    out = run(
        ns.size,
        ns.dir,
        ns.block_size,
        ns.queue_depth,
        ns.intra_op_parallelism,
        ns.rounds,
        not ns.no_ds,
    )
    print(report(out))
    print(json.dumps(out))
