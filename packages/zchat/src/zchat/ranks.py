"""Run a stage on ``world`` local ranks: one process each, joined into a gloo process group.

``z chat`` stages call :func:`run_on_ranks` from the command's process. Each rank is a fresh
interpreter (multiprocessing "spawn": nothing inherited, so it may use CUDA) that joins
``torch.distributed`` over TCP on a free local port, sets one intra-op thread per rank
(``threads``; ranks share the machine's cores), runs ``fn(rank, world, *args)`` and sends
back its return value or its traceback. ``world == 1`` runs ``fn`` in this process, without
a process group. A failed rank fails the call, naming the rank, with
its traceback; its peers are stopped. A rank dies with the process that started it
(:func:`zcore.lifetime.die_with_parent`): a ``kill -9`` of a ``z chat`` command, or of a
script calling :func:`run_on_ranks`, leaves no rank behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from typing import Any

from zcore.process import free_port


class RankFailed(RuntimeError):
    """A rank raised or died; the message has its traceback."""


def _main(
    rank: int,
    world: int,
    port: int,
    threads: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    parent: int,
) -> None:
    from zcore.lifetime import die_with_parent

    die_with_parent(parent, f"rank {rank}")  # no orphan ranks after a kill -9 of the command
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world: int,
    args: tuple[Any, ...] = (),
    threads: int = 1,
    timeout_s: float = 3600.0,
) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]``, each on its own rank.

    ``fn`` must be a module-level function (the ranks import it) and its return value
    picklable."""
    if world < 1:
        raise ValueError(f"`world` must be ≥ 1, got {world}")
    if world == 1:  # no process group needed (zcore runs single-process without one)
        import torch

        torch.set_num_threads(threads)
        try:
            return [fn(0, 1, *args)]
        except Exception as err:
            raise RankFailed(f"rank 0 failed:\n{traceback.format_exc()}") from err
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_main, args=(r, world, port, threads, fn, args, queue, os.getpid()), daemon=False
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            try:
                rank, kind, payload = queue.get(timeout=5.0)
            except Exception:  # queue.Empty: check for a rank that died without a word
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results
                ]
                if dead:
                    raise RankFailed(
                        f"rank {dead[0]} died (exit code "
                        f"{procs[dead[0]].exitcode}) before reporting"
                    ) from None
                timeout_s -= 5.0
                if timeout_s <= 0:
                    raise RankFailed(
                        f"ranks still running after the timeout: "
                        f"{sorted(set(range(world)) - set(results))}"
                    ) from None
                continue
            if kind == "error":
                raise RankFailed(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10.0 if len(results) == world else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]
