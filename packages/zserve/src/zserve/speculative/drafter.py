"""The drafter seam: what the engine asks of a draft method (`factory.py` builds one by name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
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
