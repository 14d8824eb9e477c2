"""One request's state as the scheduler sees it: tokens, progress, KV ownership."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from zserve.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: its KV was dropped, to be recomputed)
    RUNNING = "running"  # holds KV blocks; gets tokens scheduled every step it fits
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request in the scheduler. `num_computed_tokens` of `token_ids` have their
    keys/values in the KV cache; the rest are scheduled in chunks. A decoding
    sequence has exactly one uncomputed token: the one it sampled last."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # engine-side state (generator...)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens not yet in the KV cache (1 for a decoding sequence)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_len(self) -> int:
        """Tokens the KV cache must hold at most: the last sampled token is never fed back."""
        return len(self.prompt_token_ids) + max(self.params.max_tokens, 1) - 1

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
