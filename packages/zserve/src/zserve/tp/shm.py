"""All-reduce and all-gather through shared memory, for tensor-parallel ranks on one host.

A decode step of an ``L``-layer model runs ``2 L`` all-reduces of a few KB each; over gloo's
TCP loopback each costs a round trip through the kernel's network stack, which at batch 1
outweighs the layer's own compute. Here every rank of the group maps one POSIX shared
memory segment (a file under ``/dev/shm``) and a collective is a copy in, a flag, a wait for
the peers' flags and a read of their slots.

Layout (byte offsets)::

    0                      magic token (int64: the ranks check they mapped the same file)
    64 * (1 + p)           rank p's line, one cache line each (int64 words):
                           [seq, pid, asleep, cmd, cmd_asleep]: asleep is q + 1 while rank
                           p sleeps on rank q's seq, cmd_asleep on rank q's cmd, else 0
    data = align(64 * (1 + size), 4096)
    data + (b * size + p) * slot_bytes      buffer b (0 or 1), rank p's slot
    data + 2 * size * slot_bytes            the command slot: [kind, n, n int64s]

A collective is numbered by ``seq`` (1, 2, ...; every rank runs the same sequence, as with
any process group) and uses buffer ``seq % 2``: rank p copies its data into its slot, stores
``seq`` in its line, waits until every peer's line reads ``>= seq``, then reads the peers'
slots. Two buffers make this safe without a second flag: a rank can only write buffer ``b``
again at ``seq + 2``, after every peer has reached ``seq + 1``, that is, after each has
finished reading ``seq``'s slots. A tensor larger than a slot goes in slot-sized pieces, one
sequence number each.

Commands (:meth:`ShmCollectives.post` / :meth:`ShmCollectives.receive`) carry rank 0's
step to the other ranks on the same flags: rank 0 writes command ``k`` into the command slot
and stores ``k`` in its ``cmd`` word; rank p reads it and stores ``k`` in its own ``cmd``
word (the acknowledgement rank 0 waits for before it writes command ``k + 1``). A rank
waiting for the next command may wait as long as the server is idle: only rank 0's exit
ends that wait.

The sum is taken in rank order ``((x_0 + x_1) + x_2) + ...`` on every rank, so every rank
gets the same bits (at 2 ranks they are gloo's: fp addition of two terms commutes).

A wait spins briefly (a peer a few microseconds behind), then sleeps on the peer's flag word
(a Linux futex on the shared page; the peer, after storing its flag, wakes it when the
waiter's ``asleep`` says so): a waiting rank gives its core to the peer it waits for, which
matters when the ranks share cores with other work. While the host's CPUs are not crowded
(:func:`zserve.tp.futex.cpus_crowded`: every rank has a core) a wait spins on for twice the
last wait that ended in a sleep, up to :data:`SPIN_MAX_S`: a sleeping rank wakes tens of
microseconds after its peer's flag, and 60 such waits a decode step add up. Each sleep is at most :data:`NAP_S` (a
wake lost to the store/load race between ``asleep`` and the flag costs no more); every
:data:`CHECK_S` the wait looks up the awaited peer's process and raises ``RuntimeError`` at
once when it has exited, or when ``timeout_s`` passes, so a dead or stopped rank never hangs
the others.

The segment is created by rank 0 with ``O_EXCL`` and its space reserved
(``posix_fallocate``: a full ``/dev/shm`` fails here, not later with SIGBUS), its name
broadcast over the process group, and unlinked as soon as every rank has mapped it (or the
set-up failed): nothing is left under ``/dev/shm`` even if a rank is killed later.

The flag protocol relies on x86-64's store ordering (a rank's data stores are visible before
its later flag store); elsewhere :func:`supported` is False and the group keeps gloo.
"""

from __future__ import annotations

import atexit
import os
import platform
import secrets
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zserve.tp.futex import Timespec, alive, cpus_crowded, futex_wait, futex_wake, syscall

SLOT_BYTES = 1 << 20
"""Bytes of one rank's slot in one buffer (a larger tensor goes in pieces)."""
SHM_DIR = Path("/dev/shm")
LINE = 64
"""Bytes of a rank's flag line (a cache line: ranks never write the same line)."""
SPINS = 1000
"""Flag reads before a wait sleeps on the flag (tens of microseconds)."""
NAP_S = 0.005
"""The longest sleep on a flag: a wake lost to a race costs at most this."""
CHECK_S = 0.02
"""How often a long wait looks for the awaited peer's process and the timeout."""
IDLE_NAP_S = 0.1
"""The longest sleep of a rank waiting a second or more for rank 0's next command."""
SPIN_MAX_S = 0.002
"""The longest a wait spins before it sleeps, while the host's CPUs are not crowded."""
CMD_BYTES = 1 << 20
"""Bytes of the command slot (a larger command's payload travels another way)."""
SEQ, PID, ASLEEP, CMD, CMD_ASLEEP = range(5)
"""The int64 words of a rank's line."""
_VIEWS = 256
"""Sizes whose slot views are kept (a step's shapes repeat)."""
_NAP = Timespec(0, int(NAP_S * 1e9))
_IDLE_NAP = Timespec(0, int(IDLE_NAP_S * 1e9))


def supported() -> bool:
    """Whether this host can run the shared-memory collectives (Linux ``/dev/shm`` and
    futexes on x86-64, whose stores are seen by other cores in program order)."""
    return (
        sys.platform == "linux"
        and platform.machine().lower() in ("x86_64", "amd64")
        and syscall is not None
        and SHM_DIR.is_dir()
    )


_PENDING: set[Path] = set()
"""Segments created here and not yet unlinked (set-up under way)."""


@atexit.register
def _unlink_pending() -> None:
    for path in list(_PENDING):
        path.unlink(missing_ok=True)


def _data_offset(size: int) -> int:
    return -(-LINE * (1 + size) // 4096) * 4096


def _cmd_offset(size: int, slot_bytes: int) -> int:
    return _data_offset(size) + 2 * size * slot_bytes


class ShmCollectives:
    """The shared-memory collectives of rank ``rank`` of ``size`` (see the module docstring).

    Build it with :meth:`open` on every rank at once; use it only while every rank is on the
    same host (the group's ranks are spawned on loopback).
    """

    def __init__(
        self, mem: torch.Tensor, rank: int, size: int, slot_bytes: int, timeout_s: float
    ) -> None:
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        self.seq = 0
        self._mem = mem  # uint8 (total,), MAP_SHARED
        # int64 lines read and written as Python ints (a memoryview: no numpy scalars)
        header = mem[: _data_offset(size)].view(torch.int64).numpy()
        self._lines = memoryview(header)  # type: ignore[arg-type]
        self._addr = mem.data_ptr()
        self._mine = LINE // 8 * (1 + rank)
        self._asleep = self._mine + 2  # whom this rank sleeps on, plus one (0: nobody)
        self._me = rank + 1
        self._peers = [(p, LINE // 8 * (1 + p)) for p in range(size) if p != rank]
        self._sleepers = [i + 2 for _, i in self._peers]
        data = _data_offset(size)
        self._slots = [
            [
                mem[data + (b * size + p) * slot_bytes : data + (b * size + p + 1) * slot_bytes]
                for p in range(size)
            ]
            for b in range(2)
        ]
        self._views: dict[tuple[torch.Size, torch.dtype], list[list[torch.Tensor]]] = {}
        at = _cmd_offset(size, slot_bytes)
        self._cmd = mem[at : at + CMD_BYTES].view(torch.int64)  # [kind, n, payload...]
        self.commands = 0
        """Commands posted (rank 0) or received (the others) so far."""
        self._spin = [0.0, 0.0]
        """Seconds a collective's wait, a command's, spins on after :data:`SPINS` reads."""

    @staticmethod
    def segment_bytes(size: int, slot_bytes: int = SLOT_BYTES) -> int:
        """Bytes of the segment of ``size`` ranks."""
        return _cmd_offset(size, slot_bytes) + CMD_BYTES

    @classmethod
    def open(
        cls,
        rank: int,
        size: int,
        timeout_s: float,
        *,
        slot_bytes: int = SLOT_BYTES,
        group: dist.ProcessGroup | None = None,
    ) -> ShmCollectives | None:
        """Map the group's segment on every rank of ``group`` (a collective over it: every
        rank calls this at once). None on every rank when any rank could not map it (no
        ``/dev/shm``, no space, another host): the caller keeps its process group's
        collectives."""
        if slot_bytes <= 0 or slot_bytes % 4096:
            raise ValueError(f"slot_bytes {slot_bytes} must be a positive multiple of 4096")
        total = cls.segment_bytes(size, slot_bytes)
        path: Path | None = None
        mem: torch.Tensor | None = None
        token = 0
        try:
            if rank == 0 and supported():
                token = secrets.randbits(62) + 1
                try:
                    path, mem = _create(total, token)
                except (OSError, RuntimeError):  # no space or no /dev/shm: every rank keeps gloo
                    path, mem = None, None
            shared: list[object] = [str(path) if path else None, token]
            dist.broadcast_object_list(shared, src=0, group=group)
            if rank != 0 and shared[0] is not None:
                mem = _attach(Path(str(shared[0])), total, int(shared[1]))  # type: ignore[call-overload]
            if mem is not None:
                lines = mem[: _data_offset(size)].view(torch.int64)
                lines[LINE // 8 * (1 + rank) + PID] = os.getpid()
            ok = torch.tensor([int(mem is not None)], dtype=torch.int64)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank has mapped it
        finally:
            if path is not None:
                path.unlink(missing_ok=True)
                _PENDING.discard(path)
        if not int(ok):
            return None
        assert mem is not None
        return cls(mem, rank, size, slot_bytes, timeout_s)

    # -- the collectives ---------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks in place (rank order, the same bits on every rank)."""
        if t.is_contiguous() and t.numel() * t.element_size() <= self.slot_bytes:
            self._reduce(t)  # a layer's all-reduce: one piece, slots shaped like ``t``
            return
        flat = t.contiguous().view(-1)
        per = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), per):
            self._reduce(flat[start : start + per])
        if flat.data_ptr() != t.data_ptr():
            t.copy_(flat.view(t.shape))

    def _reduce(self, piece: torch.Tensor) -> None:
        slots = self._publish(piece)
        torch.add(slots[0], slots[1], out=piece)
        for s in slots[2:]:
            piece.add_(s)

    def all_gather(self, t: torch.Tensor, *, keep: bool = True) -> torch.Tensor | None:
        """Every rank's ``t`` (the same shape on each) stacked ``(size, *t.shape)``; with
        ``keep=False`` this rank only gives its own and gets None (a gather to the others)."""
        flat = t.reshape(-1)
        n = flat.numel()
        out = torch.empty((self.size, n), dtype=t.dtype) if keep else None
        per = self.slot_bytes // flat.element_size()
        for start in range(0, n, per):
            end = min(n, start + per)
            slots = self._publish(flat[start:end])
            if out is not None:
                for p, s in enumerate(slots):
                    out[p, start:end].copy_(s)
        return None if out is None else out.view(self.size, *t.shape)

    def _publish(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """Copy ``piece`` (contiguous, at most a slot) into this rank's slot of the next
        sequence number, announce it, wait for every peer's, and return every rank's slot
        viewed as ``piece``'s shape and dtype, in rank order (valid until the sequence number
        after next)."""
        self.seq += 1
        seq = self.seq
        key = (piece.shape, piece.dtype)
        views = self._views.get(key)
        if views is None:
            views = self._shaped(piece)
        slots = views[seq & 1]
        slots[self.rank].copy_(piece)
        lines = self._lines
        lines[self._mine] = seq
        for i in self._sleepers:
            if lines[i] == self._me:  # a peer sleeps on this rank's flag
                futex_wake(self._addr + 8 * self._mine)
                break
        for p, i in self._peers:
            if lines[i] < seq:
                self._wait(p, i, seq, self._asleep)
        return slots

    def _shaped(self, piece: torch.Tensor) -> list[list[torch.Tensor]]:
        """Both buffers' slots viewed as ``piece``'s shape and dtype (kept for the next)."""
        if len(self._views) >= _VIEWS:
            self._views.clear()
        nbytes = piece.numel() * piece.element_size()
        views = [
            [s[:nbytes].view(piece.dtype).view(piece.shape) for s in buf] for buf in self._slots
        ]
        self._views[(piece.shape, piece.dtype)] = views
        return views

    def _wait(
        self,
        peer: int,
        flag: int,
        seq: int,
        asleep: int,
        what: str = "shared-memory collective",
        idle: bool = False,
    ) -> None:
        """Until word ``flag`` of the header (rank ``peer``'s) reads ``>= seq``: spin, then
        sleep on it (a futex ``peer`` wakes when this rank's word ``asleep`` says so); raises
        ``RuntimeError`` when ``peer``'s process is gone or, unless ``idle``, ``timeout_s``
        passes (an ``idle`` wait's naps grow to :data:`IDLE_NAP_S` after a second)."""
        lines = self._lines
        for _ in range(SPINS):
            if lines[flag] >= seq:
                return
        kind = int(what == "command")
        spin, start = self._spin[kind], time.monotonic()
        if spin and not cpus_crowded():  # each rank has a core: spin on, as long as is worth it
            end = start + spin
            while time.monotonic() < end:
                for _ in range(64):
                    if lines[flag] >= seq:
                        return
        now = time.monotonic()
        check = now + CHECK_S
        deadline = float("inf") if idle else now + self.timeout_s
        pid = int(lines[LINE // 8 * (1 + peer) + PID])
        addr, nap = self._addr + 8 * flag, _NAP
        try:
            while True:
                lines[asleep] = peer + 1  # wake me (read by peer after its flag store)
                seen = lines[flag]
                if seen >= seq:
                    return
                futex_wait(addr, seen, nap)  # until woken, the flag changes, or the nap
                if lines[flag] >= seq:
                    waited = time.monotonic() - start  # a sleep: would a longer spin have done?
                    self._spin[kind] = min(SPIN_MAX_S, 2 * waited) if waited < SPIN_MAX_S else 0.0
                    return
                now = time.monotonic()
                if now >= check:
                    if not alive(pid):
                        raise RuntimeError(
                            f"rank {peer} (pid {pid}) exited while rank {self.rank} waited "
                            f"for it in {what} {seq}"
                        )
                    if now >= deadline:
                        raise RuntimeError(
                            f"rank {peer} did not reach {what} {seq} within "
                            f"{self.timeout_s:g} s (rank {self.rank} waited)"
                        )
                    if idle and now - start > 1.0:
                        nap = _IDLE_NAP
                    check = now + CHECK_S
        finally:
            lines[asleep] = 0

    # -- rank 0's commands ---------------------------------------------------------------
    def fits(self, n: int) -> bool:
        """Whether a command of ``n`` int64s fits the command slot."""
        return 8 * (2 + n) <= CMD_BYTES

    def post(self, kind: int, payload: torch.Tensor) -> None:
        """Rank 0: command ``(kind, payload)`` (int64) to every other rank, once each has
        read the last; a payload that does not :meth:`fits` is left out (its length still
        goes: the caller sends it another way). Raises ``RuntimeError`` when a rank is gone or
        has not read the last command within ``timeout_s``."""
        lines, k = self._lines, self.commands
        for p, i in self._peers:  # every rank has read command k (the slot is free)
            if lines[i + CMD] < k:
                self._wait(p, i + CMD, k, self._mine + CMD_ASLEEP, "command")
        n = payload.numel()
        if self.fits(n):
            self._cmd[2 : 2 + n].copy_(payload)
        self._cmd[0], self._cmd[1] = kind, n
        self.commands = k + 1
        lines[self._mine + CMD] = k + 1
        for _, i in self._peers:
            if lines[i + CMD_ASLEEP] == self._me:
                futex_wake(self._addr + 8 * (self._mine + CMD))
                break

    def receive(self) -> tuple[int, int, torch.Tensor | None]:
        """A rank other than 0: rank 0's next command ``(kind, n, payload)`` (``payload`` a
        copy of the ``n`` int64s, None when they did not fit), waiting as long as rank 0's
        process lives."""
        k = self.commands + 1
        zero = LINE // 8
        if self._lines[zero + CMD] < k:
            self._wait(0, zero + CMD, k, self._mine + CMD_ASLEEP, "command", idle=True)
        kind, n = (int(v) for v in self._cmd[:2].tolist())
        payload = self._cmd[2 : 2 + n].clone() if self.fits(n) else None
        self.commands = k
        self._lines[self._mine + CMD] = k  # read: rank 0 may write the next
        if self._lines[zero + CMD_ASLEEP] == self._me:
            futex_wake(self._addr + 8 * (self._mine + CMD))
        return kind, n, payload

    def close(self) -> None:
        """Unmap the segment (when the last view of it goes)."""
        self._views.clear()
        self._slots = []
        self._lines = None  # type: ignore[assignment]
        self._mem = None  # type: ignore[assignment]


def _create(total: int, token: int) -> tuple[Path, torch.Tensor]:
    """Rank 0's new segment of ``total`` bytes, its space reserved, stamped with ``token``."""
    path = SHM_DIR / f"zserve-tp-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, total)
        finally:
            os.close(fd)
        mem = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    _PENDING.add(path)  # unlinked at exit if this process ends before every rank mapped it
    mem[:LINE].view(torch.int64)[0] = token
    return path, mem


def _attach(path: Path, total: int, token: int) -> torch.Tensor | None:
    """The segment rank 0 made, or None when this rank cannot see it (another host)."""
    try:
        if path.stat().st_size != total:
            return None
        mem = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
    if int(mem[:LINE].view(torch.int64)[0]) != token:
        return None
    return mem
