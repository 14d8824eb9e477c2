"""Prompt-lookup (n-gram) drafting: text that repeats itself predicts itself.

The draft for a sequence is the tokens that followed an earlier occurrence of its last
n tokens, in its own prompt + output; n goes from `prompt_lookup_max` down to
`prompt_lookup_min` and the longest n that matches wins (vLLM's `ngram` method,
"prompt lookup decoding"). Costs no model forward: it pays off on inputs the output
quotes or continues (summaries, code edits, retrieval, repetitive text).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from zserve.speculative.drafter import DraftRequest

if TYPE_CHECKING:
    from zserve.scheduler import Sequence


def ngram_propose(tokens: Seq[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the last n of `tokens`,
    for the largest n in [min_n, max_n] that occurs earlier. Of the occurrences, the
    latest one followed by k tokens is taken (recent context predicts best), else the
    earliest (the longest continuation). [] when nothing matches.

    >>> ngram_propose([1, 2, 3, 9, 1, 2], k=2, max_n=3, min_n=1)
    [3, 9]
    """
    length = len(tokens)
    if k < 1 or length < 2:
        return []
    arr = torch.tensor(list(tokens), dtype=torch.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n :]
        # Windows starting at 0 .. length - n - 1: each has at least one token after it.
        windows = arr[: length - 1].unfold(0, n, 1)  # (length - n, n)
        starts = torch.nonzero((windows == suffix).all(dim=1)).flatten()
        if starts.numel() == 0:
            continue
        full = starts[starts + n + k <= length]
        i = int(full[-1]) if full.numel() else int(starts[0])
        return arr[i + n : i + n + k].tolist()
    return []


class NgramDrafter:
    """`ngram_propose` over each sequence's prompt + output (no model, no KV)."""

    name = "ngram"

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 2) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min {prompt_lookup_min} and prompt_lookup_max "
                f"{prompt_lookup_max} must satisfy 1 <= min <= max"
            )
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def _draft(self, seq: Sequence, k: int) -> list[int]:
        # Asked twice per step (scheduling, then proposing): computed once per length.
        key = (seq.num_tokens, k)
        cached = seq.extra.get("ngram_draft")
        if cached is None or cached[0] != key:
            cached = (key, ngram_propose(seq.token_ids, k, self.max_n, self.min_n))
            seq.extra["ngram_draft"] = cached
        return cached[1]

    def max_draft(self, seq: Sequence, k: int) -> int:
        return len(self._draft(seq, k))

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            cached = r.seq.extra.get("ngram_draft")
            draft = cached[1] if cached and cached[0][0] == r.seq.num_tokens else None
            if draft is None:
                draft = ngram_propose(r.seq.token_ids, r.max_tokens, self.max_n, self.min_n)
            out.append(list(draft[: r.max_tokens]))
        return out
