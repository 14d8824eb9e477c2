"""Multi-rank tests on CPU: run a function on `world_size` real gloo ranks.

Like DeepSpeed's `DistributedTest`, each rank is its own process, joined
into one `torch.distributed` process group over TCP on a free local port
chosen per call. The parent turns what the ranks did into one pytest outcome:

- every rank returned: `run_ranks` returns their values, in rank order;
- a rank raised: `AssertionError` naming the rank, with its traceback;
- a rank called `pytest.skip`: the test is skipped with that reason;
- a rank died without reporting (`os._exit`, a segfault): failure with its exit code;
- `timeout` passed: every rank is stopped and the failure names the ones still running.

`fn` must be importable by the children (a module-level function in a test
module; the root `pyproject.toml` puts the repository on `pythonpath` so
`tests.<pkg>.test_x` imports there) and its return value picklable.

Ranks start from multiprocessing's "forkserver", not "spawn": the server is a
fresh interpreter like a spawned child (nothing inherited from pytest, CUDA
never initialized, so ranks may use CUDA) that imports torch once; each rank
then forks from it in ~0.05 s instead of importing torch itself, which takes
4-10 s per call on a 2-core machine. Each rank gets the caller's current
`os.environ`; only variables that torch reads at import time come from the
environment the server started with.
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
from typing import Any, NamedTuple

import pytest

from zcore.process import free_port

# After one rank fails, the others usually stop on their own within moments (gloo sees the
# peer go away); this bounds how long a rank stuck elsewhere delays the report.
_GRACE_S = 3.0
_STOP_S = 5.0
# Imported once by the fork server, so ranks start with them loaded.
_PRELOAD = ["torch", "torch.distributed", __name__]


class _Outcome(NamedTuple):
    """What one rank reported: kind "ok" (payload: return value), "error" (traceback),
    "skip" (reason) or "died" (exit code); `at` is `time.monotonic()` when it happened,
    which is one clock for every process on the machine."""

    kind: str
    payload: Any
    at: float


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    conn: mpc.Connection,
) -> None:
    """Child entry point: join the group, run `fn`, send one `_Outcome`, leave the group."""
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    # The ranks share a few cores: intra-op threads would only oversubscribe them.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
    except BaseException:
        _send(conn, _Outcome("error", traceback.format_exc(), time.monotonic()))
        return
    try:
        result = fn(rank, world_size, *args)
    except pytest.skip.Exception as exc:
        outcome = _Outcome("skip", str(exc.msg), time.monotonic())
    except BaseException:  # pytest.fail and KeyboardInterrupt are BaseExceptions too
        outcome = _Outcome("error", traceback.format_exc(), time.monotonic())
    else:
        # Report first: leaving the group can block on a collective a peer abandoned (a
        # test of a stuck rank), and the result is already final.
        _send(conn, _Outcome("ok", result, time.monotonic()))
        dist.destroy_process_group()
        return
    # Report before leaving the group: the peers fail as soon as this rank is gone.
    _send(conn, outcome)
    dist.destroy_process_group()


def _send(conn: mpc.Connection, outcome: _Outcome) -> None:
    try:
        # plain pickle: tensors travel by value (multiprocessing's pickler would share their
        # storage through file descriptors that die with this process)
        conn.send_bytes(pickle.dumps(outcome))
    except Exception:  # the return value did not pickle
        error = f"the return value could not be sent:\n{traceback.format_exc()}"
        conn.send_bytes(pickle.dumps(_Outcome("error", error, outcome.at)))


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    # Exit code 1 before any report is usually the child failing to unpickle `fn`.
    hint = " (its stderr says why; is `fn` importable?)" if code == 1 else ""
    return f"exited with exit code {code}{hint}"


def _stop(procs: Sequence[BaseProcess], *, graceful: bool) -> None:
    """Reap every rank, terminating (then killing) those still alive: no zombies, no orphans.

    With `graceful`, ranks get `_STOP_S` to finish leaving the process group first.
    """
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


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks of one process group.

    Returns the ranks' return values in rank order. Raises `AssertionError` if a
    rank raised, died, or did not finish within `timeout` seconds (the message
    names the rank that failed first, then the others), and calls `pytest.skip`
    if the first rank to stop early did so by calling `pytest.skip`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
    port = free_port()
    env = dict(os.environ)
    procs: list[BaseProcess] = []
    readers: dict[mpc.Connection, int] = {}
    outcomes: dict[int, _Outcome] = {}
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, world_size, port, backend, timeout, fn, tuple(args), env, writer),
                name=f"rank{rank}",
                daemon=True,
            )
            proc.start()
            # Only the child may hold the write end, so its death reads as EOF here.
            writer.close()
            procs.append(proc)
            readers[reader] = rank
        outcomes = _collect(procs, readers, timeout)
    finally:
        all_ok = len(outcomes) == world_size and all(o.kind == "ok" for o in outcomes.values())
        _stop(procs, graceful=all_ok)
        for reader in readers:
            reader.close()
    return _verdict(outcomes, world_size, timeout)


def _collect(
    procs: Sequence[BaseProcess], readers: dict[mpc.Connection, int], timeout: float
) -> dict[int, _Outcome]:
    """Wait for each rank's outcome or death; stop waiting `_GRACE_S` after the first failure."""
    outcomes: dict[int, _Outcome] = {}
    pending = dict(readers)
    deadline = time.monotonic() + timeout
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
                outcomes[rank] = _Outcome("died", procs[rank].exitcode, died_at)
        if any(o.kind != "ok" for o in outcomes.values()):
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    return outcomes


def _verdict(outcomes: dict[int, _Outcome], world_size: int, timeout: float) -> list[Any]:
    failures = sorted(
        ((o.at, rank, o) for rank, o in outcomes.items() if o.kind != "ok"), key=lambda f: f[:2]
    )
    unfinished = [rank for rank in range(world_size) if rank not in outcomes]
    if failures:
        _, first_rank, first = failures[0]
        if first.kind == "skip":
            pytest.skip(f"rank {first_rank}: {first.payload}")
        lines = []
        for _, rank, outcome in failures:
            if outcome.kind == "error":
                lines.append(f"rank {rank} of {world_size} raised:\n{outcome.payload}")
            elif outcome.kind == "died":
                exit_text = _describe_exit(outcome.payload)
                lines.append(f"rank {rank} of {world_size} {exit_text} without reporting a result")
            else:
                lines.append(f"rank {rank} of {world_size} skipped: {outcome.payload}")
        if unfinished:
            lines.append(f"ranks {unfinished} were stopped after rank {first_rank} failed")
        raise AssertionError("\n".join(lines))
    if unfinished:
        raise AssertionError(
            f"ranks {unfinished} of {world_size} did not finish within {timeout} s "
            f"(finished: {sorted(outcomes)}); all ranks were stopped"
        )
    return [outcomes[rank].payload for rank in range(world_size)]
