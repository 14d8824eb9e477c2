"""Run a function on ``world`` local ranks: one process each, joined into one process group.

The one local rank spawner: ``z chat``'s stages (:func:`zchat.ranks.run_on_ranks`) and the
multi-rank tests (``tests/utils/distributed.py``) are thin fronts on :func:`run_ranks`.

Each rank is a process of a ``spawn`` or ``forkserver`` multiprocessing context (a fresh
interpreter: nothing inherited, so a rank may use CUDA; the fork server imports
``preload`` once, so its ranks start without importing torch again). A rank gets the
caller's current environment plus ``torch.distributed``'s ``env://`` variables, runs with
``threads`` intra-op threads (ranks share the machine's cores), joins a gloo group on a free
127.0.0.1 port, runs ``fn(rank, world, *args)`` and sends back one :class:`Outcome` on a
pipe of its own: its return value (pickled by value: tensors are copied, not shared) or the
traceback of what it raised. A rank that dies without a word reads as EOF, its exit code the
outcome. After the first failure the others get ``grace_s`` to report; at ``timeout_s``
every rank still running is stopped. Every rank is reaped (no zombies); with
``die_with_caller`` (``spawn`` only: a fork server's ranks are its children, not the
caller's) a rank also dies with the caller, even after a ``kill -9``
(:func:`zcore.lifetime.die_with_parent`).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any, Literal, NamedTuple

from zcore.process import free_port

_STOP_S = 5.0


class Outcome(NamedTuple):
    """What one rank reported: ``kind`` "ok" (``payload``: its return value), "error"
    (``payload``: the traceback; ``exc_type``: the exception's ``module.QualName``,
    ``message``: its message) or "died" (``payload``: the exit code). ``at`` is
    ``time.monotonic()`` when it happened, one clock for every process on the machine."""

    kind: str
    payload: Any
    at: float
    exc_type: str = ""
    message: str = ""


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    *,
    threads: int = 1,
    timeout_s: float = 3600.0,
    start_method: Literal["spawn", "forkserver"] = "spawn",
    preload: Sequence[str] = (),
    die_with_caller: bool = False,
    group_timeout_s: float | None = None,
    grace_s: float = 3.0,
    backend: str = "gloo",
) -> dict[int, Outcome]:
    """Each rank's :class:`Outcome`, by rank; a rank missing from the dict was still running
    at ``timeout_s`` and was stopped. ``fn`` must be importable by the ranks (a module-level
    function) and its return value picklable. ``group_timeout_s``: the process group's
    collective timeout (default: torch's); ``backend``: the group's (gloo, or nccl for
    ranks that each own a GPU). See the module doc; :func:`describe` words the
    failures."""
    if world < 1:
        raise ValueError(f"`world` must be >= 1, got {world}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver" and preload:
        ctx.set_forkserver_preload([*preload, __name__])  # no effect once the server runs
    env = dict(os.environ)
    caller = os.getpid() if die_with_caller else None
    for _ in range(PORT_ATTEMPTS):
        spec = (world, free_port(), threads, group_timeout_s, env, caller, backend)
        outcomes = _run_once(ctx, fn, tuple(args), spec, timeout_s, grace_s)
        if not _port_taken(outcomes):
            break
    return outcomes


PORT_ATTEMPTS = 3
"""Starts of the ranks when rank 0 finds the rendezvous port taken: :func:`free_port`'s port
was free when read, and another process (a peer job's connection) may take it before rank 0
binds it; nothing of ``fn`` has run then, so the ranks start again on a new port."""


def _port_taken(outcomes: dict[int, Outcome]) -> bool:
    """Whether rank 0 failed to bind the rendezvous port (before ``fn`` ran)."""
    o = outcomes.get(0)
    return (
        o is not None
        and o.kind == "error"
        and "init_process_group" in str(o.payload)
        and ("EADDRINUSE" in str(o.payload) or "address already in use" in str(o.payload))
    )


def _run_once(
    ctx: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    spec: tuple[Any, ...],
    timeout_s: float,
    grace_s: float,
) -> dict[int, Outcome]:
    """One start of the ranks on ``spec``'s port; their outcomes (see :func:`run_ranks`)."""
    world = spec[0]
    procs: list[BaseProcess] = []
    readers: dict[mpc.Connection, int] = {}
    outcomes: dict[int, Outcome] = {}
    try:
        for rank in range(world):
            reader, writer = ctx.Pipe(duplex=False)
            # not daemonic: a rank may start processes of its own; every rank is reaped below
            proc = ctx.Process(
                target=_rank_main, args=((rank, *spec), fn, args, writer), name=f"rank{rank}"
            )
            proc.start()
            writer.close()  # only the child holds the write end: its death reads as EOF
            procs.append(proc)
            readers[reader] = rank
        outcomes = _collect(procs, readers, timeout_s, grace_s)
    finally:
        all_ok = len(outcomes) == world and all(o.kind == "ok" for o in outcomes.values())
        _stop(procs, graceful=all_ok)
        for reader in readers:
            reader.close()
    return outcomes


def first_failure(outcomes: dict[int, Outcome]) -> tuple[int, Outcome] | None:
    """(rank, outcome) of the rank that failed first, or None."""
    failures = sorted((o.at, r) for r, o in outcomes.items() if o.kind != "ok")
    return (failures[0][1], outcomes[failures[0][1]]) if failures else None


def describe(outcomes: dict[int, Outcome], world: int, timeout_s: float) -> str | None:
    """What went wrong, the first failed rank first (None: every rank returned)."""
    failures = sorted((o.at, r) for r, o in outcomes.items() if o.kind != "ok")
    unfinished = [r for r in range(world) if r not in outcomes]
    lines = []
    for _, rank in failures:
        o = outcomes[rank]
        if o.kind == "error":
            lines.append(f"rank {rank} of {world} raised:\n{o.payload}")
        else:
            lines.append(
                f"rank {rank} of {world} {_exit_text(o.payload)} without reporting a result"
            )
    if failures and unfinished:
        lines.append(f"ranks {unfinished} were stopped after rank {failures[0][1]} failed")
    elif unfinished:
        lines.append(
            f"ranks {unfinished} of {world} did not finish within {timeout_s:g} s "
            f"(finished: {sorted(outcomes)}); all ranks were stopped"
        )
    return "\n".join(lines) or None


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    # Exit code 1 before any report is usually the child failing to unpickle `fn`.
    hint = " (its stderr says why; is `fn` importable?)" if code == 1 else ""
    return f"exited with exit code {code}{hint}"


def _rank_main(
    spec: tuple[Any, ...], fn: Callable[..., Any], args: tuple[Any, ...], conn: mpc.Connection
) -> None:
    """A rank: join the group, run ``fn``, send one :class:`Outcome`, leave the group."""
    rank, world, port, threads, group_timeout_s, env, caller, backend = spec
    if caller is not None:
        from zcore.lifetime import die_with_parent

        die_with_parent(caller, f"rank {rank}")  # no orphan rank after a kill -9 of the caller
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS=str(threads),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        kwargs = {} if group_timeout_s is None else {"timeout": timedelta(seconds=group_timeout_s)}
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kwargs
        )
    except BaseException as exc:
        _send(conn, _error(exc))
        return
    try:
        result = fn(rank, world, *args)
    except BaseException as exc:  # pytest's outcomes and KeyboardInterrupt are BaseExceptions
        outcome = _error(exc)
    else:
        # Report first: leaving the group can block on a collective a peer abandoned, and
        # the result is already final.
        _send(conn, Outcome("ok", result, time.monotonic()))
        dist.destroy_process_group()
        return
    _send(conn, outcome)  # before leaving: the peers fail as soon as this rank is gone
    dist.destroy_process_group()


def _error(exc: BaseException) -> Outcome:
    kind = type(exc)
    message = str(getattr(exc, "msg", None) or exc)
    exc_type = f"{kind.__module__}.{kind.__qualname__}"
    return Outcome("error", traceback.format_exc(), time.monotonic(), exc_type, message)


def _send(conn: mpc.Connection, outcome: Outcome) -> None:
    try:
        conn.send_bytes(pickle.dumps(outcome))  # plain pickle: tensors travel by value
    except Exception:  # the return value did not pickle
        error = f"the return value could not be sent:\n{traceback.format_exc()}"
        conn.send_bytes(pickle.dumps(Outcome("error", error, outcome.at)))


def _collect(
    procs: Sequence[BaseProcess],
    readers: dict[mpc.Connection, int],
    timeout_s: float,
    grace_s: float,
) -> dict[int, Outcome]:
    """Each rank's outcome or death; stop waiting ``grace_s`` after the first failure."""
    outcomes: dict[int, Outcome] = {}
    pending = dict(readers)
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        # A reader turns ready on a message or, once its rank is gone, on EOF.
        for reader in mpc.wait(list(pending), remaining):
            rank = pending.pop(reader)
            try:
                outcomes[rank] = pickle.loads(reader.recv_bytes())
            except (EOFError, OSError):
                died_at = time.monotonic()
                procs[rank].join(_STOP_S)
                outcomes[rank] = Outcome("died", procs[rank].exitcode, died_at)
        if any(o.kind != "ok" for o in outcomes.values()):
            deadline = min(deadline, time.monotonic() + grace_s)
    return outcomes


def _stop(procs: Sequence[BaseProcess], *, graceful: bool) -> None:
    """Reap every rank, terminating (then killing) those still alive. With ``graceful``,
    ranks get a few seconds to finish leaving the process group first."""
    deadline = time.monotonic() + _STOP_S
    if graceful:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _STOP_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
