"""Tensor-parallel serving: rank 0's runner, which the engine drives, and the workers' loop.

The engine's process is rank 0: it runs the scheduler (and the HTTP server), and its
:class:`TPRunner` is the engine's runner. It spawns ranks ``1 .. tp-1``
(``torch.multiprocessing``, spawn), each building the same :class:`~zserve.runner.ModelRunner`
over its :class:`~zserve.tp.plan.RankShard`. Each step rank 0 posts the batch (token ids,
positions, block tables: :mod:`zserve.tp.wire`, sent by :meth:`~zserve.tp.group.TPGroup.post`),
every rank runs the forward on its shard (an all-reduce after each o and each MLP), and rank 0
gathers the logits' columns and samples. One scheduler and one block manager drive every rank: a request's blocks are
allocated, shared and freed once, and each rank's cache follows the same block ids.

A rank that dies or stops answering ends the engine with a :class:`~zserve.tp.group.TPRankError`
naming it (see :mod:`zserve.tp.group`); the workers exit with rank 0 (their next command
fails, and each also watches its parent).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zserve.model.config import LlamaConfig
from zserve.runner import ModelRunner, SeqChunk
from zserve.tp import wire
from zserve.tp.group import Collectives, TPGroup, TPRankError, free_port
from zserve.tp.quantized import connect, plan_dir

log = logging.getLogger(__name__)

STOP, STEP, GREEDY = 0, 1, 2
"""Rank 0's commands: stop; run a step, gather its logits; run a step, gather each logits
row's largest value and its column (:meth:`TPRunner.forward_greedy`)."""


class TPRunner:
    """The engine's runner over ``tp`` ranks (this process is rank 0).

    This process's torch threads are shared out: every rank, this one included, runs
    ``torch.get_num_threads() // tp`` of them (at least one; znative's pool the same where
    ``ZNATIVE_NUM_THREADS`` is unset and the pool not yet started), and where this process
    may run on enough cores each rank is pinned to cores of its own (:func:`rank_cpus`).

    Args:
        model_dir: HF model directory (plain safetensors), or a `z quantize` directory.
        tp: ranks, ``2 <= tp <= num_attention_heads`` (:func:`zserve.tp.plan.plan`).
        timeout_s: how long a collective of a step waits for a rank before the engine stops.
        collectives: what carries the layers' collectives and each step's batch:
            ``"p2p"`` (point-to-point sends and receives, :mod:`zserve.tp.p2p`) or
            ``"gloo"`` (the groups' collectives).
        runner_kwargs: :class:`~zserve.runner.ModelRunner`'s keyword arguments, the same on
            every rank.
    """

    def __init__(
        self,
        model_dir: str | Path,
        tp: int,
        *,
        timeout_s: float = 120.0,
        collectives: Collectives = "p2p",
        **runner_kwargs: Any,
    ) -> None:
        shards = plan_dir(model_dir, tp)  # a bad --tp fails here, before any process starts
        if dist.is_initialized():
            raise RuntimeError(
                "tensor-parallel serving starts its own process group, but this process "
                f"already has one (world {dist.get_world_size()}); serve from a plain process"
            )
        self.tp = tp
        self.widths = [s.vocab[1] - s.vocab[0] for s in shards]
        self.failure: TPRankError | None = None
        self._closed = False
        # this process's threads are shared out: each rank (this one too) runs its share
        threads = max(1, torch.get_num_threads() // tp)
        torch.set_num_threads(threads)
        cpus = [rank_cpus(r, tp, threads) for r in range(tp)]
        # taken back at close, on this thread even when close runs on another (the
        # engine's, after a rank failed)
        self._pinned_thread = threading.get_native_id()
        self._affinity = _pin(cpus[0])
        # if its pool is not up yet; taken back at close (later processes of this one, e.g. a
        # `z doctor` it starts, would otherwise inherit one rank's share)
        self._threads_env = "ZNATIVE_NUM_THREADS" not in os.environ
        os.environ.setdefault("ZNATIVE_NUM_THREADS", str(threads))
        # rank 0's shard first: a bad option fails here, before any process starts
        try:
            self.local = ModelRunner(model_dir, tp=shards[0], **runner_kwargs)
        except BaseException:
            _unpin(self._pinned_thread, self._affinity)
            raise
        port = free_port()
        common = (tp, port, str(model_dir), runner_kwargs, timeout_s, threads, collectives)
        ctx = mp.get_context("spawn")
        self.procs = {
            r: ctx.Process(
                target=worker_main,
                args=(r, *common, cpus[r]),
                name=f"zserve-tp{r}",
                daemon=True,
            )
            for r in range(1, tp)
        }
        for p in self.procs.values():
            p.start()
        self._finalizer = weakref.finalize(self, _stop_procs, list(self.procs.values()))
        try:
            self.group = self._join(port, timeout_s, collectives)
            self.group.describe_failure = self._describe
            self.local.model.reduce = self.group.all_reduce
            connect(self.local.model, self.group)
            self._wait_ready()
        except BaseException as exc:
            failure = None
            if isinstance(exc, RuntimeError) and not isinstance(exc, TPRankError):
                failure = self._describe("start-up", exc)  # before the ranks are stopped
            _stop_procs(list(self.procs.values()))
            if dist.is_initialized():
                dist.destroy_process_group()
            _unpin(self._pinned_thread, self._affinity)
            if failure is not None:
                raise failure from exc
            raise

    # -- what the engine reads ------------------------------------------------------------
    @property
    def model(self) -> Any:
        """Rank 0's shard of the model (the engine takes its ``step_threads``)."""
        return self.local.model

    @property
    def config(self) -> LlamaConfig:
        return self.local.config

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    @property
    def block_size(self) -> int:
        return self.local.block_size

    @property
    def max_model_len(self) -> int:
        return self.local.max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        return self.local.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def greedy_skips_logits(self) -> bool:
        """True: :meth:`forward_greedy` gathers two numbers a row and rank, not the logits."""
        return True

    # -- the step ---------------------------------------------------------------------------
    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """:meth:`ModelRunner.forward` over every rank: fp32 logits ``(n, vocab)``.

        Raises:
            ValueError: a bad chunk (checked before any rank sees the batch).
            TPRankError: a rank died or stopped answering (now, or at an earlier step).
        """
        if not chunks:
            return self.local.forward(chunks)
        return self._step(chunks, STEP)

    def forward_greedy(self, chunks: list[SeqChunk]) -> list[int]:
        """The greedy token of each logits row :meth:`forward` would return (its argmax, the
        first column of the largest value, as ``Sampler.sample`` picks), without gathering
        the logits: each rank sends its columns' largest value and where it is."""
        if not chunks:
            return []
        best = self._step(chunks, GREEDY)
        if not best.shape[0]:
            return []
        values, columns = best[:, 0::2], best[:, 1::2]
        rank = values.argmax(dim=-1, keepdim=True)  # ties: the lowest rank, lowest columns
        return [int(c) for c in columns.gather(1, rank).view(-1).tolist()]

    def _step(self, chunks: list[SeqChunk], kind: int) -> torch.Tensor:
        """Every rank's forward of ``chunks``; the gathered logits (``STEP``) or each rank's
        ``(largest value, its vocab column)`` per row side by side (``GREEDY``)."""
        if self.failure is not None:
            raise self.failure
        for c in chunks:
            self.local._validate(c)
        g = self.group
        g.begin_step()
        try:
            sent = g.post(kind, wire.encode(chunks))
            local = self.local.forward(chunks)
            if not local.shape[0]:
                width = self.vocab_size if kind == STEP else 2 * self.tp
                logits = torch.empty((0, width), dtype=torch.float32)
            else:
                gathered = _gather(g, local, kind, self.widths)
                assert gathered is not None
                logits = gathered
            for w in sent:
                w.wait()
        except BaseException as exc:
            failure = exc if isinstance(exc, TPRankError) else self._describe("forward", exc)
            self.failure = failure  # type: ignore[assignment]
            self.close()
            if failure is exc:
                raise
            raise failure from exc
        return logits

    # -- failures and shutdown ----------------------------------------------------------
    def _describe(self, what: str, exc: BaseException) -> TPRankError:
        """A :class:`TPRankError` for ``what`` failing with ``exc``, naming the dead rank."""
        deadline = time.monotonic() + 2.0  # a rank whose socket closed exits just after
        while time.monotonic() < deadline and all(p.is_alive() for p in self.procs.values()):
            time.sleep(0.05)
        dead = {r: p.exitcode for r, p in self.procs.items() if p.exitcode is not None}
        step = getattr(getattr(self, "group", None), "step", 0)
        where = what if " of step " in what or not step else f"{what} of step {step}"
        if dead:
            ranks = ", ".join(f"rank {r} (exit code {code})" for r, code in sorted(dead.items()))
            msg = f"tensor-parallel {ranks} died during {where}"
        else:
            msg = (
                f"tensor-parallel {where} failed with every rank alive: a rank did not "
                f"answer within the collective timeout ({exc})"
            )
        return TPRankError(
            f"{msg}; the engine stops (a rank's own error is in its log): restart the server"
        )

    def _check_alive(self, what: str) -> None:
        dead = {r: p.exitcode for r, p in self.procs.items() if not p.is_alive()}
        if dead:
            raise TPRankError(
                f"tensor-parallel rank(s) {sorted(dead)} exited (exit codes "
                f"{list(dead.values())}) while {what}; see their error above"
            )

    def _join(self, port: int, timeout_s: float, collectives: Collectives) -> TPGroup:
        """Rank 0's rendezvous, in a thread polled so that a rank that dies before joining
        is named at once instead of waited for."""
        joined: list[TPGroup | BaseException] = []

        def join() -> None:
            try:
                joined.append(TPGroup.join(0, self.tp, port, timeout_s, collectives))
            except BaseException as exc:  # handed to the caller
                joined.append(exc)

        thread = threading.Thread(target=join, name="zserve-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            self._check_alive("starting")
            thread.join(0.05)
        if isinstance(joined[0], BaseException):
            raise joined[0]
        return joined[0]

    def _wait_ready(self) -> None:
        """Every rank loaded its shard (a barrier polled, so a rank that dies while loading
        is named at once)."""
        work = dist.barrier(async_op=True)  # the default group: bounded by STARTUP
        while not work.is_completed():
            self._check_alive("loading the model")
            time.sleep(0.01)
        work.wait()

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            try:  # the workers leave their loop and exit
                for w in self.group.post(STOP, torch.empty(0, dtype=torch.int64)):
                    w.wait()
            except RuntimeError:
                pass
        # a worker past its loop has nothing left to do: no need to wait out its exit
        _stop_procs(list(self.procs.values()), grace_s=0.5)
        self.group.close()
        if self._threads_env:
            os.environ.pop("ZNATIVE_NUM_THREADS", None)
        _unpin(self._pinned_thread, self._affinity)


def _gather(
    group: TPGroup, local: torch.Tensor, kind: int, widths: list[int]
) -> torch.Tensor | None:
    """Rank 0: the logits' columns of every rank (``STEP``), or each rank's largest logit of
    each row and its vocab column, ``(rows, 2 * tp)`` (``GREEDY``); None elsewhere."""
    if kind == STEP:
        return group.gather_columns(local, widths)
    column = local.argmax(dim=-1, keepdim=True)
    start = sum(widths[: group.rank])
    # fp32 holds every vocab column exactly (below 2**24)
    mine = torch.cat([local.gather(1, column), (column + start).float()], dim=1)
    return group.gather_columns(mine, [2] * len(widths))


def rank_cpus(rank: int, tp: int, threads: int) -> set[int] | None:
    """The cores rank ``rank`` of ``tp`` is pinned to: its ``threads`` of the cores this
    process may run on, in order; None (not pinned) where fewer than ``tp * threads`` are
    allowed, or the OS sets no affinity. A pinned rank's compute thread and gloo's thread
    share its core, so a collective's wake-up stays on it: unpinned ranks on a loaded host
    wait milliseconds for gloo's point-to-point receives (``zserve.tp.p2p``)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < tp * threads:
        return None
    return set(allowed[rank * threads : (rank + 1) * threads])


def _pin(cpus: set[int] | None) -> set[int] | None:
    """Run this thread, and the threads it starts from now on, on ``cpus`` (nothing where
    None); the cores it ran on before."""
    if cpus is None:
        return None
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    return before


def _unpin(thread: int, cpus: set[int] | None) -> None:
    """Run thread ``thread`` (a native id) on ``cpus`` again (nothing where None, or where the
    thread has ended)."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(thread, cpus)
    except OSError:  # the thread is gone
        pass


def _stop_procs(procs: list[Any], grace_s: float = 2.0) -> None:
    """Join ``procs``, terminating (then killing) those still running after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


def _exit_with_parent(parent: int) -> None:
    """A worker's watchdog: exit when rank 0's process is gone (even by SIGKILL)."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)


def worker_main(
    rank: int,
    tp: int,
    port: int,
    model_dir: str,
    runner_kwargs: dict[str, Any],
    timeout_s: float,
    threads: int,
    collectives: Collectives = "p2p",
    cpus: set[int] | None = None,
) -> None:
    """Rank ``rank`` (>= 1): load the shard, then run each step rank 0 posts (on ``cpus``
    where given, :func:`rank_cpus`)."""
    os.environ["ZNATIVE_NUM_THREADS"] = str(threads)  # before the first kernel starts the pool
    torch.set_num_threads(threads)
    _pin(cpus)
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    group = TPGroup.join(rank, tp, port, timeout_s, collectives)
    shards = plan_dir(model_dir, tp)
    runner = ModelRunner(model_dir, tp=shards[rank], **runner_kwargs)
    runner.model.reduce = group.all_reduce
    connect(runner.model, group)
    widths = [s.vocab[1] - s.vocab[0] for s in shards]
    dist.barrier()  # ready (the default group, bounded by the start-up timeout)
    while True:
        kind, payload = group.receive()
        if kind == STOP:
            break
        group.expect_command()  # the next one, so that rank 0 can send it at once
        chunks = wire.decode(payload)
        group.begin_step()
        tokens = sum(len(c.token_ids) for c in chunks)
        rows = wire.logit_rows(chunks)
        with runner.model.step_threads(tokens, rows):
            local = runner.forward(chunks)
        if rows:
            _gather(group, local, kind, widths)
    group.close()
