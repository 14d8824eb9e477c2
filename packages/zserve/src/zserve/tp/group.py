"""The tensor-parallel process group of a served model: torch.distributed (gloo on CPU,
NCCL on GPU) over loopback, built with torch's ``init_device_mesh``.

Its groups, over the same ranks:

* ``compute`` — the mesh's ``tp`` group: the layers' all-reduces (and all-gathers, for a
  quantized layer cut by output rows) and the logits' gather.
  Bounded by ``timeout_s``: a rank that dies or stops answering fails the collective (gloo
  raises on a closed connection at once, on a silent peer at the timeout), never a hang.
* the default group (the rendezvous) — only the ready barrier after loading, bounded by
  :data:`STARTUP`;
* ``control`` — rank 0's command of each step, its batch (:meth:`TPGroup.post`). Workers wait
  on it between requests, for as long as the server is idle, so its timeout is long; rank 0
  posts it asynchronously and the step's compute collectives are what notice a missing rank.

With ``collectives="p2p"`` (the default) the compute collectives and each step's batch go
as point-to-point sends and receives on those same groups (:mod:`zserve.tp.p2p`: one
exchange per all-reduce at 2 ranks instead of a gloo collective's several round trips);
``"gloo"`` uses the groups' collectives (``all_reduce``, ``all_gather``, ``gather``,
``broadcast``).

Every collective error on rank 0 becomes a :class:`TPRankError` naming the op, the step and
the rank (by its process's exit code when it died, else every rank still alive is named as
possibly stuck).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed.device_mesh import init_device_mesh

from zserve.tp.p2p import P2PCollectives

IDLE_TIMEOUT = timedelta(days=30)
"""How long a worker waits for rank 0's next step (the server may sit idle)."""
STARTUP = timedelta(minutes=15)
"""How long the rendezvous and the ready barrier wait for every rank to load its shard."""

Collectives = Literal["p2p", "gloo"]
"""How the compute collectives and step commands travel over the groups: point-to-point
sends and receives (:mod:`zserve.tp.p2p`), or the groups' collectives."""


class TPRankError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot step again and
    the server stops (the message names the rank, the op and the step)."""

    fatal = True
    """The server's engine thread stops on it instead of failing only the step's requests."""


def free_port() -> int:
    """A loopback port free now (the kernel's pick) for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TRANSPORT_THREAD = "gloo_tcp_loop"
"""The name gloo gives its transport threads (one per process group)."""


def quiet_transport_threads() -> int:
    """Run this process's gloo transport threads under ``SCHED_BATCH`` at nice 19 (Linux;
    elsewhere, or where the OS refuses, nothing changes); how many were changed.

    A transport thread handles a message only when it can take its connection's lock, and
    otherwise polls again at once. Scheduled while the rank's own thread held that lock
    (inside a ``send`` or ``recv``) on the rank's core, it spun until the scheduler took
    the core back: 8-25 ms of a tp=2 decode step. ``SCHED_BATCH`` stops it preempting that
    thread when a message wakes it, nice 19 makes it yield the core at the scheduler's ticks;
    it still runs whenever the rank's thread waits, which is when a message is needed, and
    keeps a small fair share (never starved, unlike ``SCHED_IDLE``) on a busy core.
    Measurements: ``benchmarks/results/serve-tp.md``.
    """
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not os.path.isdir("/proc/self/task"):
        return 0
    changed = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != TRANSPORT_THREAD:
                    continue
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, int(tid), 19)
        except OSError:  # the thread ended, or the OS refuses: it stays as it was
            continue
        changed += 1
    return changed


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group and its two process groups."""

    rank: int
    size: int
    compute: dist.ProcessGroup
    control: dist.ProcessGroup
    timeout_s: float
    step: int = 0
    """Steps run so far (named in errors)."""
    _ops: int = 0
    describe_failure: Callable[[str, BaseException], BaseException] | None = field(
        default=None, repr=False
    )
    """Rank 0's: turns a failed collective into a :class:`TPRankError` naming the rank."""
    p2p: P2PCollectives | None = field(default=None, repr=False)
    """The point-to-point collectives, when they carry the compute collectives and commands."""

    def __post_init__(self) -> None:
        self._reduce: Callable[[torch.Tensor], object] = (
            self.p2p.all_reduce
            if self.p2p is not None
            else partial(dist.all_reduce, group=self.compute)
        )

    @property
    def collectives(self) -> Collectives:
        """What carries the compute collectives."""
        return "p2p" if self.p2p is not None else "gloo"

    @classmethod
    def join(
        cls, rank: int, size: int, port: int, timeout_s: float, collectives: Collectives = "p2p"
    ) -> TPGroup:
        """Join the ``size``-rank group whose rank 0 listens on loopback ``port`` (the
        rendezvous waits up to :data:`STARTUP` for every rank's process to come up)."""
        if collectives not in ("p2p", "gloo"):
            raise ValueError(f"tp collectives {collectives!r}: use 'p2p' or 'gloo'")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=STARTUP,
        )
        bounded = C10dBackend.Options("gloo", timedelta(seconds=timeout_s))
        mesh = init_device_mesh(
            "cpu", (size,), mesh_dim_names=("tp",), backend_override={"tp": ("gloo", bounded)}
        )
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        assert isinstance(control, dist.ProcessGroup)  # every rank is a member
        compute = mesh.get_group("tp")
        quiet_transport_threads()
        p2p = P2PCollectives(rank, size, compute, control) if collectives == "p2p" else None
        return cls(rank, size, compute, control, timeout_s, p2p=p2p)

    def begin_step(self) -> None:
        self.step += 1
        self._ops = 0

    def post(self, kind: int, payload: torch.Tensor) -> list[dist.Work]:
        """Rank 0: command ``(kind, payload)`` (int64) to the other ranks over ``control``;
        the sends (or broadcasts) still in flight are returned (wait on them after the
        step's collectives)."""
        if self.p2p is not None:
            try:
                return self.p2p.post(kind, payload)
            except RuntimeError as exc:
                raise self._failed("command", exc) from exc
        header = torch.tensor([kind, payload.numel()], dtype=torch.int64)
        works = []
        for t in (header, payload):
            if t.numel():
                work = dist.broadcast(t, 0, group=self.control, async_op=True)
                assert work is not None
                works.append(work)
        return works

    def receive(self) -> tuple[int, torch.Tensor]:
        """A rank other than 0: rank 0's next :meth:`post`, as long as the server idles."""
        if self.p2p is not None:
            return self.p2p.receive()
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.control)
        payload = torch.empty(int(header[1]), dtype=torch.int64)
        if payload.numel():
            dist.broadcast(payload, 0, group=self.control)
        return int(header[0]), payload

    def expect_command(self) -> None:
        """A rank other than 0, as a step starts: post the receive of rank 0's next command
        (point-to-point only: a broadcast cannot be posted ahead)."""
        if self.p2p is not None:
            self.p2p.expect_command()

    def _failed(self, op: str, exc: BaseException) -> BaseException:
        what = f"{op} of step {self.step}"
        if self.describe_failure is not None:
            return self.describe_failure(what, exc)
        return TPRankError(f"tensor-parallel rank {self.rank}: {what} failed: {exc}")

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks in place (the k-th call of a step: layer k // 2's o
        projection for even k, its MLP for odd k)."""
        k = self._ops
        self._ops += 1
        try:
            self._reduce(t)
        except RuntimeError as exc:
            part = "attention" if k % 2 == 0 else "mlp"
            raise self._failed(f"all_reduce after layer {k // 2} ({part})", exc) from exc

    def all_gather_columns(self, local: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's ``(n, widths[r])`` columns side by side ``(n, sum)``, on every rank
        (the input of a projection cut by output rows, :mod:`zserve.tp.quantized`)."""
        try:
            parts = self._gather(local, widths, everyone=True)
        except RuntimeError as exc:
            raise self._failed(f"all_gather before layer {self._ops // 2}", exc) from exc
        assert parts is not None
        return torch.cat([q[:, :w] for q, w in zip(parts, widths, strict=True)], dim=1)

    def gather_columns(self, local: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank 0: every rank's ``(n, widths[r])`` columns side by side ``(n, sum)``; other
        ranks send theirs and get None."""
        try:
            parts = self._gather(local, widths, everyone=False)
        except RuntimeError as exc:
            raise self._failed("gather of the logits", exc) from exc
        if parts is None:
            return None
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)

    def _gather(
        self, local: torch.Tensor, widths: list[int], everyone: bool
    ) -> list[torch.Tensor] | None:
        """Every rank's ``local`` padded to ``max(widths)`` columns, in rank order, on every
        rank (``everyone``) or on rank 0 only (None elsewhere)."""
        wide = max(widths)
        if local.shape[1] < wide:
            local = torch.nn.functional.pad(local, (0, wide - local.shape[1]))
        local = local.contiguous()
        keep = everyone or self.rank == 0
        if self.p2p is not None:
            stacked = self.p2p.all_gather(local, everyone=everyone)
            return None if stacked is None else list(stacked.unbind(0))
        parts = [torch.empty_like(local) for _ in widths] if keep else None
        if everyone:
            dist.all_gather(parts, local, group=self.compute)  # type: ignore[arg-type]
        else:
            dist.gather(local, parts, dst=0, group=self.compute)
        return parts

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
