"""Multi-rank tests on CPU: run a function on `world_size` real gloo ranks.

Like DeepSpeed's `DistributedTest`, each rank is its own process, joined into one
`torch.distributed` process group over TCP on a free local port chosen per call. The ranks
are `zcore.ranks.run_ranks`'s (the spawner `z chat` uses too); this module turns what they
did into one pytest outcome:

- every rank returned: `run_ranks` returns their values, in rank order;
- a rank raised: `AssertionError` naming the rank, with its traceback;
- a rank called `pytest.skip`: the test is skipped with that reason;
- a rank died without reporting (`os._exit`, a segfault): failure with its exit code;
- `timeout` passed: every rank is stopped and the failure names the ones still running.

`fn` must be importable by the children (a module-level function in a test module; the root
`pyproject.toml` puts the repository on `pythonpath` so `tests.<pkg>.test_x` imports there)
and its return value picklable.

Ranks start from multiprocessing's "forkserver", not "spawn": the server is a fresh
interpreter like a spawned child (nothing inherited from pytest, CUDA never initialized, so
ranks may use CUDA) that imports torch once; each rank then forks from it in ~0.05 s instead
of importing torch itself, which takes 4-10 s per call on a 2-core machine. Each rank gets
the caller's current `os.environ`; only variables that torch reads at import time come from
the environment the server started with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from zcore import ranks
from zcore.process import free_port

__all__ = ["free_port", "run_ranks"]

# Imported once by the fork server, so ranks start with them loaded. torch._dynamo is what
# the first `torch.optim.Optimizer()` of a process imports (~1.5 CPU-s even from bytecode);
# transformers is what every Hugging Face rank imports (~3 CPU-s a rank).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "transformers", __name__]
_SKIPPED = f"{pytest.skip.Exception.__module__}.{pytest.skip.Exception.__qualname__}"


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
    outcomes = ranks.run_ranks(
        fn,
        world_size,
        args,
        threads=1,  # the ranks share a few cores: more threads would only oversubscribe them
        timeout_s=timeout,
        start_method="forkserver",
        preload=_PRELOAD,
        group_timeout_s=timeout,
        backend=backend,
    )
    first = ranks.first_failure(outcomes)
    if first is not None and first[1].exc_type == _SKIPPED:
        pytest.skip(f"rank {first[0]}: {first[1].message}")
    problem = ranks.describe(outcomes, world_size, timeout)
    if problem is not None:
        raise AssertionError(problem)
    return [outcomes[rank].payload for rank in range(world_size)]
