"""The engine's side of speculative decoding: which sequences get drafts, proposing
them, greedy acceptance, and the counters behind `Engine.stats()`.

Greedy acceptance: the target scores the pending token and the d drafts in one forward
(1 + d logits rows); row i is the target's distribution after draft i. Draft i is
accepted while it equals the target's argmax at row i - 1; the first mismatch (or the
row after the last draft) gives the target's own token. The emitted tokens are exactly
the argmaxes plain greedy decoding would have produced one step at a time.

Sampled acceptance (temperature > 0, top_k != 1): every drafter here proposes a
deterministic draft, a point mass q at each draft token x, so speculative sampling's
rule (Leviathan et al.; Chen et al.) becomes: accept x with probability p(x), where p is
the target's sampling distribution at that row (temperature, top-k and top-p applied);
at the first rejection draw from p with x removed and renormalized, i.e. max(0, p - q)
normalized; if every draft is accepted, draw the bonus token from the last row. Each
emitted token is then distributed exactly as plain sampling's: P(y) = p(x)[y = x] +
(1 - p(x)) p(y)[y != x] / (1 - p(x)) = p(y).

A request with a `seed` gets no drafts and decodes plainly: how many drafts a sequence
gets depends on the step's token budget, hence on the other requests in the batch, and
the seed promises output independent of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zserve.speculative.drafter import Drafter, DraftRequest

if TYPE_CHECKING:
    from zserve.block_manager import BlockManager
    from zserve.scheduler import ScheduledChunk, Sequence


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """Tokens emitted when `target` (the target's argmax at each of the 1 + d rows)
    checks `draft` (d tokens): the accepted drafts, then the target's next token.

    >>> accept_greedy([5, 6, 7], [5, 6, 9, 1])
    [5, 6, 9]
    """
    if len(target) != len(draft) + 1:
        raise ValueError(f"{len(target)} target tokens for {len(draft)} drafts; need d + 1")
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return target[: a + 1]


def accept_sampled(draft: list[int], probs: torch.Tensor, gen: torch.Generator) -> list[int]:
    """Tokens emitted when the target's sampling distributions ``probs`` (1 + d, V) check
    a deterministic ``draft`` (d tokens) by speculative sampling (see the module's
    docstring): the accepted drafts, then one token drawn by the rule."""
    if probs.shape[0] != len(draft) + 1:
        raise ValueError(f"{probs.shape[0]} distributions for {len(draft)} drafts; need d + 1")
    for i, x in enumerate(draft):
        p = probs[i]
        if float(torch.rand((), generator=gen)) < float(p[x]):
            continue
        residual = p.clone()
        residual[x] = 0.0
        if float(residual.sum()) <= 0.0:  # p(x) is 1 up to rounding: nothing else to draw
            continue
        return [*draft[:i], int(torch.multinomial(residual, 1, generator=gen))]
    return [*draft, int(torch.multinomial(probs[len(draft)], 1, generator=gen))]


@dataclass
class SpecStats:
    """Counters of one engine's speculative decoding."""

    verify_steps: int = 0
    """Sequence-steps that verified at least one draft token."""
    proposed: int = 0
    """Draft tokens verified by the target."""
    accepted: int = 0
    """Of those, tokens the target agreed with."""
    emitted: int = 0
    """Tokens those verify steps produced (accepted drafts + the target's own)."""

    def as_dict(self) -> dict[str, int | float]:
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_emitted_tokens": self.emitted,
            "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_mean_accepted_per_step": (
                self.accepted / self.verify_steps if self.verify_steps else 0.0
            ),
        }


class SpeculativeDecoder:
    """Ties a `Drafter` to the engine's step: lookahead for the scheduler, drafts for the
    scheduled decodes, acceptance of the verified rows."""

    def __init__(self, drafter: Drafter, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens is {num_speculative_tokens}; need >= 1")
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.stats = SpecStats()

    def lookahead(self, seq: Sequence) -> int:
        """Drafts `seq` would verify this step (the scheduler's `lookahead` hook)."""
        if not seq.params.greedy and seq.params.seed is not None:
            return 0  # a seeded request's output must not depend on the batch
        return self.drafter.max_draft(seq, self.k)

    def propose(self, chunks: list[ScheduledChunk], kv: BlockManager) -> list[list[int]]:
        """A draft per chunk ([] for chunks without reserved slots)."""
        want = [i for i, c in enumerate(chunks) if c.num_lookahead > 0]
        drafts: list[list[int]] = [[] for _ in chunks]
        if not want:
            return drafts
        requests = [
            DraftRequest(
                chunks[i].seq, chunks[i].num_lookahead, kv.block_table(chunks[i].seq.seq_id)
            )
            for i in want
        ]
        for i, r, d in zip(want, requests, self.drafter.propose(requests), strict=True):
            if len(d) > r.max_tokens:
                raise RuntimeError(
                    f"drafter {self.drafter.name!r} proposed {len(d)} tokens for "
                    f"{r.max_tokens} reserved slots"
                )
            drafts[i] = list(d)
        return drafts

    def verify(
        self,
        draft: list[int],
        rows: torch.Tensor,
        probs: torch.Tensor | None = None,
        gen: torch.Generator | None = None,
    ) -> list[int]:
        """Emitted tokens of a draft from its `(1 + d, vocab)` target logits; counted.
        Greedy acceptance, or sampled acceptance when the request samples: ``probs`` are
        then its sampling distributions at those rows and ``gen`` its generator."""
        if probs is None:
            out = accept_greedy(draft, rows.argmax(dim=-1).tolist())
        else:
            if gen is None:
                raise ValueError("sampled acceptance needs the request's generator")
            out = accept_sampled(draft, probs, gen)
        self.stats.verify_steps += 1
        self.stats.proposed += len(draft)
        self.stats.accepted += len(out) - 1
        self.stats.emitted += len(out)
        return out
