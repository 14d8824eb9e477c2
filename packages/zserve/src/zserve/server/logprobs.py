"""The engine's `TokenLogprob`s in OpenAI's two shapes.

Completions (legacy): parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``
(a dict token text -> logprob per position) and ``text_offset`` (each token's first
character in the choice's text, counted over the token texts, as vLLM does). Chat:
``content``, one ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``
per generated token.

A token's text is its bytes decoded as UTF-8 (a token holding part of a character shows
U+FFFD; its ``bytes`` are exact). The numbers are log-softmax of the model's raw logits,
before temperature, top-k and top-p (see `zserve.sampling.SamplingParams.logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from zserve.logprobs import TokenLogprob
from zserve.server.protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob


class TokenTexts:
    """Token id -> (text, bytes) for one tokenizer, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.get = lru_cache(maxsize=65536)(self._get)

    def _get(self, token_id: int) -> tuple[str, bytes]:
        fn = getattr(self._tok, "token_bytes", None)
        if fn is not None:
            raw = fn(token_id)
        else:  # a tokenizer without byte access (test fakes): its decoded text
            raw = self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return raw.decode("utf-8", errors="replace"), raw

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def completion_logprobs(
    texts: TokenTexts,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    offset: int = 0,
) -> tuple[CompletionLogprobs, int]:
    """The legacy shape of ``token_ids`` (``entries`` aligned with them; None: no logprob,
    the first prompt token's), text offsets from ``offset``; and the offset after them."""
    out = CompletionLogprobs()
    for tok, entry in zip(token_ids, entries, strict=True):
        text = texts.text(tok)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry.logprob)
        top: dict[str, float] = {}
        for t, lp in entry.top:
            top.setdefault(texts.text(t), lp)  # two ids with one text: the likelier
        out.top_logprobs.append(top)
    return out, offset


def chat_logprobs(texts: TokenTexts, entries: Sequence[TokenLogprob]) -> list[ChatTokenLogprob]:
    """Chat's ``logprobs.content`` entries of generated tokens."""
    out = []
    for entry in entries:
        text, raw = texts.get(entry.token_id)
        top = []
        for t, lp in entry.top:
            t_text, t_raw = texts.get(t)
            top.append(TopLogprob(token=t_text, logprob=lp, bytes=list(t_raw)))
        out.append(
            ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=list(raw), top_logprobs=top)
        )
    return out
