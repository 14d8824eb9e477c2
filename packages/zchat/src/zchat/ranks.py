"""Run a stage on ``world`` local ranks: one process each, joined into a gloo process group.

``z chat`` stages call :func:`run_on_ranks` from the command's process; the ranks are
:func:`zcore.ranks.run_ranks`'s (fresh ``spawn`` interpreters, so they may use CUDA; one
gloo group on a free local port; ``threads`` intra-op threads each, as ranks share the
machine's cores). ``world == 1`` runs ``fn`` in this process, without a process group. A
failed rank fails the call, naming the rank, with its traceback; its peers are stopped. A
rank dies with the process that started it (:func:`zcore.lifetime.die_with_parent`): a
``kill -9`` of a ``z chat`` command, or of a script calling :func:`run_on_ranks`, leaves no
rank behind.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from zcore.ranks import describe, run_ranks


class RankFailed(RuntimeError):
    """A rank raised or died; the message has its traceback."""


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
    outcomes = run_ranks(
        fn, world, args, threads=threads, timeout_s=timeout_s, die_with_caller=True
    )
    problem = describe(outcomes, world, timeout_s)
    if problem is not None:
        raise RankFailed(problem)
    return [outcomes[r].payload for r in range(world)]
