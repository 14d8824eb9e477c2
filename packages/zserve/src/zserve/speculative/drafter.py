"""The drafter seam: what the engine asks of a draft method, and the factory by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from zserve.config import EngineConfig
    from zserve.scheduler import Sequence


@dataclass(frozen=True)
class DraftRequest:
    """One decoding sequence to draft for in this step."""

    seq: Sequence
    """Its next uncomputed token is the last of `seq.token_ids`, at position
    `seq.num_computed_tokens`."""
    max_tokens: int
    """Drafts the scheduler reserved KV slots (and budget) for; propose at most this many."""
    block_table: list[int]
    """The sequence's blocks, covering positions up to `num_computed_tokens + max_tokens`."""


class Drafter(Protocol):
    """A draft method. `max_draft` is asked while scheduling (so the budget is not spent
    on slots a drafter will leave empty); `propose` runs after it, for the sequences
    that got slots, and may return fewer tokens than reserved."""

    name: str

    def max_draft(self, seq: Sequence, k: int) -> int:
        """Drafts `propose` would give `seq` this step, at most `k`."""
        ...

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """One draft (list of token ids, at most `max_tokens` long) per request."""
        ...


def make_drafter(config: EngineConfig, runner: Any) -> Drafter:
    """The drafter `config.speculative` names, over `runner` (the target's ModelRunner)."""
    if config.speculative == "ngram":
        from zserve.speculative.ngram import NgramDrafter

        return NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min)
    if config.speculative == "self-draft":
        from zserve.speculative.self_draft import SelfDrafter

        if not hasattr(runner, "model") or not hasattr(runner, "kv_cache"):
            raise ValueError(
                f"speculative 'self-draft' needs a model runner with weights; "
                f"{type(runner).__name__} has none; use speculative 'ngram'"
            )
        layers = len(runner.model.layers)
        default = max(1, layers - max(1, layers // 8))
        return SelfDrafter(runner, config.draft_layers or default)
    raise ValueError(
        f"speculative {config.speculative!r} has no drafter; use 'ngram' or 'self-draft'"
    )
