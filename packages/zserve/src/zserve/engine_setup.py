"""What the engine is built from, chosen from its config: the runner's interface
(:class:`Runner`: a plain, tensor-parallel or offloaded model runner), the scheduling policy
(:func:`make_scheduler`) and the longest request served (:func:`served_max_model_len`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from zserve.block_manager import BlockManager
from zserve.config import EngineConfig
from zserve.scheduler import PrefillFirstScheduler, Scheduler, Sequence, SplitFuseScheduler


class Runner(Protocol):
    """What the engine reads of a runner (a plain, tensor-parallel or offloaded one)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def greedy_skips_logits(self) -> bool: ...  # forward_greedy beats forward + argmax

    def forward(self, chunks: list[Any]) -> torch.Tensor: ...

    def forward_greedy(self, chunks: list[Any]) -> list[int]: ...


def merge_config(config: EngineConfig | None, overrides: dict[str, Any]) -> EngineConfig:
    """`config` with `overrides` applied (validated again)."""
    base = config.model_dump(exclude_unset=True) if config is not None else {}
    return EngineConfig(**{**base, **overrides})


def served_max_model_len(runner: Runner) -> int:
    """The longest request (prompt + max_tokens) the engine accepts: the runner's limit
    (the model's context, or the configured `max_model_len`), capped at what the KV cache
    can hold. A sequence of L tokens keeps L - 1 in the cache (the last sampled token is
    never fed back), so the cache caps it at ``num_blocks * block_size + 1``; a longer
    request could never run, and is refused up front instead of failing in the scheduler."""
    return min(runner.max_model_len, runner.num_blocks * runner.block_size + 1)


def make_scheduler(
    config: EngineConfig,
    kv: BlockManager,
    max_model_len: int,
    lookahead: Callable[[Sequence], int] | None = None,
) -> Scheduler:
    if config.policy == "splitfuse":
        return SplitFuseScheduler(kv, config.max_num_seqs, config.token_budget, lookahead)
    if config.policy == "prefill-first":
        # A prefill forward must hold the longest prompt, whatever the token budget.
        return PrefillFirstScheduler(
            kv, config.max_num_seqs, max(config.token_budget, max_model_len)
        )
    raise ValueError(
        f"policy {config.policy!r} has no scheduler; the static baseline runs through "
        "`zserve.static_batch.StaticBatchEngine` (`make_engine` picks it)"
    )
