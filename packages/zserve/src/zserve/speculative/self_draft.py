"""Layer-truncated self-drafting: the target's first L layers, its final norm and its
LM head, run as the draft model (early exit, as in LayerSkip / "draft & verify").

No extra weights: the draft is a shallow copy of the target's `LlamaModel` whose layer
list is cut to L, sharing every tensor. No KV memory of its own either: layer i < L of
the draft *is* layer i of the target, so the keys/values the draft needs for positions
the target has computed are the target's own, read from the target's paged cache
through the sequence's block table. The draft writes its keys/values for the drafted
positions (layers < L) into the same slots, which the scheduler reserved for the
verification; the target's verification forward rewrites those slots (all layers)
before it reads them, and a rejected position is rewritten again before it is next
read. So drafting never changes what the target computes.

Drafting k tokens costs k forwards of L layers + the head over the batch's decodes (one
token each); it pays off when the truncated model agrees with the full one often,
which for a model never trained to exit early needs L close to the full depth.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from zserve.model.attention import plan_ragged_attention
from zserve.speculative.drafter import DraftRequest


class SelfDrafter:
    """Greedy drafts from the first `num_layers` layers of `runner`'s model."""

    name = "self-draft"

    def __init__(self, runner: Any, num_layers: int) -> None:
        model = runner.model
        total = len(model.layers)
        if not 1 <= num_layers < total:
            raise ValueError(
                f"draft_layers {num_layers} must be in [1, {total - 1}] (the model has "
                f"{total} layers; the draft is a strict prefix of them)"
            )
        self.runner = runner
        self.num_layers = num_layers
        self.model = copy.copy(model)  # shares every tensor with the target
        self.model.layers = model.layers[:num_layers]

    def max_draft(self, seq: Any, k: int) -> int:
        return k

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        runner = self.runner
        drafts: list[list[int]] = [[] for _ in requests]
        steps = max((r.max_tokens for r in requests), default=0)
        for j in range(steps):
            live = [i for i, r in enumerate(requests) if r.max_tokens > j]
            # Step j feeds, per sequence, the token at position num_computed + j: its pending
            # token first, then its own previous draft.
            tokens = [drafts[i][j - 1] if j else requests[i].seq.token_ids[-1] for i in live]
            starts = [requests[i].seq.num_computed_tokens + j for i in live]
            plan = plan_ragged_attention(
                [1] * len(live),
                starts,
                [requests[i].block_table for i in live],
                runner.block_size,
                runner.device,
            )
            logits = self.model.forward(
                torch.tensor(tokens, dtype=torch.int64, device=runner.device),
                plan,
                runner.kv_cache,
                torch.arange(len(live), dtype=torch.int64, device=runner.device),
                attention=runner.attention,
            )  # (len(live), vocab)
            for i, tok in zip(live, logits.argmax(dim=-1).tolist(), strict=True):
                drafts[i].append(int(tok))
        return drafts
