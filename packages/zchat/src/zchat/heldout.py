"""Fixed-seed sampled answers to held-out prompts, shared by PPO's and GRPO's evaluations.

What PPO and GRPO maximise is the expected reward of the *sampling* policy, so besides the
greedy answers each held-out prompt is sampled ``k`` times at the rollout temperature. The
seeds are fixed (request ``i`` of rank ``r`` gets ``EVAL_SEED + r * len(mine) * k + i``,
whatever the run's own ``seed``), so every evaluation of every run draws the same random
numbers and a before/after difference is not blurred by sampling noise.
"""

from __future__ import annotations

from typing import Any

from zserve.sampling import SamplingParams

EVAL_SEED = 900_000_001
"""Base seed of the held-out sampled answers."""


def sampled_requests(
    prompts: list[Any],
    ids: list[list[int]],
    k: int,
    rank: int,
    max_tokens: int,
    temperature: float,
) -> tuple[list[Any], list[list[int]], SamplingParams]:
    """Each of a rank's held-out ``prompts`` (token ``ids``) repeated ``k`` times, and the
    fixed-seed sampling parameters that answer them."""
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=EVAL_SEED + rank * len(prompts) * k
    )
    return ([p for p in prompts for _ in range(k)], [i for i in ids for _ in range(k)], params)
