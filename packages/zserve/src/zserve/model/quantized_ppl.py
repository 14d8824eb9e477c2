"""Perplexity of a served model, scored through the engine as `z eval` scores it.

`z eval MODEL_DIR --ppl TEXT` (`zquant.metrics.perplexity`) cuts the first `max_tokens`
tokens of a text into non-overlapping windows of `window` tokens and reports
exp(mean next-token NLL) over every window's `window - 1` predictions. `served_perplexity`
sends the same windows to a zserve engine as scoring requests (`prompt_logprobs=0`,
`max_tokens=0`: OpenAI's echo), so the served model of a zquant directory is measured on
exactly the tokens `z eval` measured the directory on; both sides feed the same token ids.
"""

from __future__ import annotations

import math
from typing import Any

from zserve.sampling import SamplingParams


def perplexity_windows(token_ids: list[int], *, max_tokens: int, window: int) -> list[list[int]]:
    """The windows `zquant.metrics.perplexity` scores: the first `max_tokens` ids cut into
    `window`-long pieces, the last partial one dropped."""
    if window < 2 or max_tokens < window:
        raise ValueError(
            f"need 2 <= window <= max_tokens, got window={window}, max_tokens={max_tokens}"
        )
    n = min(len(token_ids), max_tokens) // window
    if n == 0:
        raise ValueError(
            f"text has {len(token_ids)} tokens, fewer than one window of {window}; "
            "pass more text or a smaller window"
        )
    return [token_ids[i * window : (i + 1) * window] for i in range(n)]


def served_perplexity(
    engine: Any, token_ids: list[int], *, max_tokens: int = 2048, window: int = 256
) -> float:
    """exp(mean NLL) of `token_ids` as `z eval --ppl` computes it, the logits from `engine`
    (a `zserve.Engine`; all windows are queued at once and batched as its scheduler likes)."""
    windows = perplexity_windows(token_ids, max_tokens=max_tokens, window=window)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    ids = [f"ppl-{i}" for i in range(len(windows))]
    for rid, w in zip(ids, windows, strict=True):
        engine.add_request(rid, w, params)
    scores: dict[str, list[Any]] = {}
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(f"scoring request {out.request_id} failed: {out.error}")
                if out.prompt_logprobs is not None:
                    scores[out.request_id] = out.prompt_logprobs
    finally:
        for rid in ids:
            engine.abort(rid)
    nll, count = 0.0, 0
    for rid, w in zip(ids, windows, strict=True):
        entries = scores.get(rid)
        if entries is None or len(entries) != len(w) or any(e is None for e in entries[1:]):
            raise RuntimeError(f"scoring request {rid} returned no logprob for every token")
        nll -= sum(e.logprob for e in entries[1:])
        count += len(w) - 1
    return math.exp(nll / count)
