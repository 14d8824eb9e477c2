"""Collectives with diagnostics: every call names itself and the step it belongs to.

A collective whose peer died fails fast inside gloo/NCCL; one whose peers are alive but
never join (a rank stuck elsewhere) would wait forever. Every wait here is bounded by
``timeout_s`` and both cases are re-raised as :class:`CollectiveError` with the rank, the
collective, the step and the fix, so a job ends instead of hanging. A collective that the
backend refuses to start (a tensor of the wrong size or device) is reported as that
error, with the same names, not as a timeout.

Every collective also adds the bytes this rank sends to :attr:`Comm.traffic`, split into
intra-node and inter-node (the model is in :mod:`zcore.comm.accounting`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from zcore.comm.accounting import Ledger, Traffic, env_node_size
from zcore.comm.groups import CUDA_BACKEND


class CollectiveError(RuntimeError):
    """A collective failed or did not complete within the configured timeout."""


class Handle:
    """An issued collective; :meth:`wait` blocks (bounded by the timeout) until it is done."""

    def __init__(self, comm: Comm, work: Any, what: str, step: int) -> None:
        self._comm = comm
        self._work = work
        self.what = what
        self.step = step

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        if not work.is_completed():
            # gloo ignores a timeout given to `wait` (and some of its ops never report
            # `is_completed`), so a helper thread blocks in `wait` while this one waits on
            # an event with the deadline.
            job = _Job(work)
            self._comm.waiter().put(job)
            if not job.done.wait(self._comm.timeout_s):
                raise self._comm.timed_out(self.what, self.step)
            if job.error is not None:
                raise self._comm.failed(self.what, self.step, job.error) from job.error
            return
        try:
            work.wait()
        except Exception as err:
            raise self._comm.failed(self.what, self.step, err) from err


class _Job:
    def __init__(self, work: Any) -> None:
        self.work = work
        self.done = threading.Event()
        self.error: BaseException | None = None


def _wait_forever(jobs: queue.SimpleQueue[_Job]) -> None:
    while True:
        job = jobs.get()
        try:
            job.work.wait()
        except BaseException as err:  # reported to the thread that asked
            job.error = err
        job.done.set()


class Comm:
    """Collectives over one process group (``None``: a single process, where they are no-ops).

    ``ranks`` (the group's global ranks in group order; default: asked of torch) and
    ``node_size`` (ranks per node; default: ``LOCAL_WORLD_SIZE``, else one node) place
    the peers for the byte accounting in :attr:`traffic`; :class:`~zcore.comm.Mesh`
    passes both.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        size: int,
        timeout_s: float,
        axis: str | None = None,
        ranks: Sequence[int] | None = None,
        node_size: int | None = None,
    ) -> None:
        self.group = group
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self.axis = axis
        """The mesh axis the group spans, named in messages (None: the whole job)."""
        self.step = 0
        """The training step the next collectives belong to (the engine keeps it current)."""
        self._jobs: queue.SimpleQueue[_Job] | None = None
        self._ranks = ranks
        self._node_size = node_size
        self._ledger: Ledger | None = None

    @property
    def traffic(self) -> dict[str, Traffic]:
        """Bytes this rank has sent through this comm, per op kind
        (:data:`~zcore.comm.accounting.OP_KINDS`), cumulative; a live view."""
        if self._ledger is None:
            if self.group is None or self.size == 1:
                return Ledger([0], 0, 1).ops
            return self._ledger_().ops
        return self._ledger.ops

    def _ledger_(self) -> Ledger:
        if self._ledger is None:
            ranks = self._ranks
            if ranks is None:
                ranks = dist.get_process_group_ranks(self.group)
            node = self._node_size or env_node_size(dist.get_world_size())
            self._ledger = Ledger(list(ranks), self.rank, node)
        return self._ledger

    def _counted(self) -> Ledger | None:
        """The ledger to charge, or None where collectives are no-ops."""
        if self.group is None or self.size == 1:
            return None
        return self._ledger or self._ledger_()

    def waiter(self) -> queue.SimpleQueue[_Job]:
        """The queue of the daemon thread that blocks on collectives for :class:`Handle`."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(
                target=_wait_forever, args=(self._jobs,), name="zcore-comm-wait", daemon=True
            ).start()
        return self._jobs

    def _where(self, what: str, step: int) -> str:
        on = f" of mesh axis `{self.axis}`" if self.axis else ""
        return f"rank {self.rank}/{self.size}{on}: collective `{what}` at step {step}"

    def _peers(self) -> str:
        """Who a failed wait points at: the other rank of two, else any peer."""
        return f"the peer rank {1 - self.rank}" if self.size == 2 else "a peer rank"

    def timed_out(self, what: str, step: int) -> CollectiveError:
        """The error for a collective still not complete after ``timeout_s``."""
        return CollectiveError(
            f"{self._where(what, step)} did not complete within {self.timeout_s:g}s\n"
            f"{self._peers()} died or is stuck; check the other ranks' logs for the first error "
            "(raise `comm_timeout_s` in the config if steps are legitimately slower)"
        )

    def failed(self, what: str, step: int, cause: BaseException) -> CollectiveError:
        """The error for a collective that started but failed while this rank waited."""
        return CollectiveError(
            f"{self._where(what, step)} failed: {type(cause).__name__}: {cause}\n"
            f"{self._peers()} may have died; check the other ranks' logs for the first error"
        )

    def refused(self, what: str, step: int, cause: BaseException) -> CollectiveError:
        """The error for a collective the backend refused to start (raise it ``from cause``)."""
        hint = ""
        if "No backend type associated with device type" in str(cause):
            hint = (
                "\nthe process group has no backend for this tensor's device (zcore reduces "
                "its scalars as CPU tensors); for a CUDA model initialize torch.distributed "
                f"with backend={CUDA_BACKEND!r}, as zcore does when it initializes it itself"
            )
        return CollectiveError(
            f"{self._where(what, step)} could not be started: {type(cause).__name__}: {cause}{hint}"
        )

    def _issue(self, what: str, fn: Any, *args: Any) -> Handle:
        if self.group is None or self.size == 1:
            return Handle(self, None, what, self.step)
        try:
            work = fn(*args, group=self.group, async_op=True)
        except Exception as err:  # refused before it started (bad argument, no backend)
            raise self.refused(what, self.step, err) from err
        return Handle(self, work, what, self.step)

    def all_reduce(self, t: torch.Tensor, what: str, op: Any = None) -> Handle:
        handle = self._issue(what, dist.all_reduce, t, op or dist.ReduceOp.SUM)
        if (ledger := self._counted()) is not None:
            ledger.all_reduce(t.numel(), t.element_size())
        return handle

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        """Sum ``inp`` (``size`` equal chunks) across ranks; this rank's chunk lands in ``out``."""
        if self.group is None or self.size == 1:
            out.copy_(inp)
            return Handle(self, None, what, self.step)
        handle = self._issue(what, dist.reduce_scatter_tensor, out, inp, dist.ReduceOp.SUM)
        self._ledger_().reduce_scatter(inp.numel() * inp.element_size())
        return handle

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        """Concatenate every rank's ``inp`` into ``out`` (rank order)."""
        if self.group is None or self.size == 1:
            out.copy_(inp)
            return Handle(self, None, what, self.step)
        handle = self._issue(what, dist.all_gather_into_tensor, out, inp)
        self._ledger_().all_gather(inp.numel() * inp.element_size())
        return handle

    def all_to_all_single(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int] | None,
        in_splits: list[int] | None,
        what: str,
    ) -> Handle:
        """Send row block ``r`` of ``inp`` (``in_splits[r]`` rows; None: ``size`` equal
        blocks) to rank ``r``; block ``r`` of ``out`` (``out_splits[r]`` rows) comes from rank
        ``r``. On a single process ``out`` is a copy of ``inp``."""
        if self.group is None or self.size == 1:
            out.copy_(inp)
            return Handle(self, None, what, self.step)
        handle = self._issue(what, dist.all_to_all_single, out, inp, out_splits, in_splits)
        rows = inp.shape[0] if inp.dim() else 0
        self._ledger_().all_to_all(inp.numel() * inp.element_size(), rows, in_splits)
        return handle

    def broadcast(self, t: torch.Tensor, src: int, what: str) -> Handle:
        """``t`` of this group's rank ``src`` (a rank within the group, not a global rank)."""
        ledger = self._counted()
        group_src = src
        if self.group is not None and self.group is not dist.group.WORLD and self.size > 1:
            src = dist.get_global_rank(self.group, src)
        handle = self._issue(what, dist.broadcast, t, src)
        if ledger is not None:
            ledger.broadcast(t.numel() * t.element_size(), group_src)
        return handle

    def barrier(self, what: str) -> None:
        flag = torch.zeros(1)
        self.all_reduce(flag, what).wait()

    def max_flag(self, local: bool, what: str) -> bool:
        """Whether any rank's ``local`` is true."""
        flag = torch.tensor([1.0 if local else 0.0])
        self.all_reduce(flag, what, dist.ReduceOp.MAX).wait()
        return bool(flag.item() > 0)

    def sum_scalar(self, value: float, what: str) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        self.all_reduce(t, what).wait()
        return float(t.item())
