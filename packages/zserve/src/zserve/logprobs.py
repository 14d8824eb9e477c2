"""The log-probabilities a request asks for: of each sampled token (``logprobs``) and of
its prompt's tokens (``prompt_logprobs``), each with its likeliest alternatives, from the
raw logits (no temperature or filtering applied)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zserve import scheduler


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the likeliest alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, logprob) of the likeliest tokens, likeliest first."""


def gather_logprobs(
    logits: torch.Tensor, targets: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    """logits: (n, V), one row per target; each row's log-softmax at its target, and its
    ``num_top[i]`` likeliest tokens. Raw logits: no temperature or filtering applied."""
    if not targets:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
    idx = torch.tensor(list(targets), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, idx[:, None]).squeeze(1).tolist()
    k = max(num_top)
    top_v: list[list[float]] = [[] for _ in targets]
    top_i: list[list[int]] = [[] for _ in targets]
    if k:
        values, ids = lp.topk(k, dim=-1)
        top_v, top_i = values.tolist(), ids.tolist()
    return [
        TokenLogprob(t, c, tuple(zip(top_i[r][:nt], top_v[r][:nt], strict=True)))
        for r, (t, c, nt) in enumerate(zip(targets, chosen, num_top, strict=True))
    ]


def scores_prompt(seq: scheduler.Sequence, start: int) -> bool:
    """Whether a chunk of `seq` from `start` needs the logits of its every token: the
    request scores its prompt, not done yet, and the chunk predicts prompt tokens."""
    return (
        seq.params.prompt_logprobs is not None
        and "prompt_lp_sent" not in seq.extra
        and start < len(seq.prompt_token_ids) - 1
    )


def record_prompt_logprobs(seq: scheduler.Sequence, start: int, rows: torch.Tensor) -> None:
    """rows: the logits at positions start.. of `seq`; row i predicts token start+i+1."""
    prompt = seq.prompt_token_ids
    lp: list[TokenLogprob | None] = seq.extra.setdefault("prompt_lp", [None] * len(prompt))
    n = min(rows.shape[0], len(prompt) - 1 - start)
    k = seq.params.prompt_logprobs or 0
    targets = prompt[start + 1 : start + 1 + n]
    for i, entry in enumerate(gather_logprobs(rows[:n], targets, [k] * n)):
        lp[start + 1 + i] = entry


def token_logprobs(
    logits: torch.Tensor, seqs: list[scheduler.Sequence], tokens: list[int]
) -> list[TokenLogprob | None]:
    """The logprob of each sampled token ``tokens[i]`` of ``seqs[i]`` (``logits`` row i),
    None where the request did not ask for logprobs."""
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if want:
        idx = torch.tensor(want, dtype=torch.int64, device=logits.device)
        got = gather_logprobs(
            logits[idx], [tokens[i] for i in want], [seqs[i].params.logprobs for i in want]
        )
        for i, entry in zip(want, got, strict=True):
            out[i] = entry
    return out
