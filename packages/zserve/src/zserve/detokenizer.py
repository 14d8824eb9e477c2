"""Incremental detokenization with stop strings.

Decoding one token at a time is wrong for byte-level BPE: a multi-byte character
can span tokens (the first decodes to U+FFFD alone), and a token's leading space
depends on its neighbour. So each step decodes a short window of tokens twice —
`ids[prefix:read]` (already emitted) and `ids[prefix:]` — and emits the difference
once it no longer ends in an incomplete character (the approach of HF TGI / vLLM).

Stop strings: text that could still become a stop string (a suffix that is a
prefix of one) is held back until the next token decides it; once a stop string
appears, the text is cut before it and the request is finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Tokens decoded before the first new one, so its leading space/merge renders as in context.
_CONTEXT = 5


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text deltas."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = tuple(stop)
        self.text = ""  # all generated text so far (stop string cut off once found)
        self._emitted = 0  # chars of self.text already returned
        self.stopped = False  # a stop string was found

    def add(self, token_id: int) -> None:
        """Append one generated token; sets `stopped` when a stop string appears."""
        if self.stopped:
            return
        self._ids.append(token_id)
        done = self._tok.decode(self._ids[self._prefix : self._read])
        full = self._tok.decode(self._ids[self._prefix :])
        if len(full) <= len(done) or full.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        old = len(self.text)
        self.text += full[len(done) :]
        self._prefix, self._read = self._read, len(self._ids)
        if self._stop:
            longest = max(map(len, self._stop))
            start = max(0, old - longest + 1)  # a stop string may straddle old and new text
            hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True

    def _held(self) -> int:
        """Chars at the end of `text` that may be the start of a stop string."""
        if self.stopped or not self._stop:
            return 0
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def delta(self, final: bool = False) -> str:
        """New text since the last call; `final` flushes held-back text too."""
        if final and not self.stopped and self._read < len(self._ids):
            # The output ended inside a character: emit what the decoder makes of it.
            done = self._tok.decode(self._ids[self._prefix : self._read])
            self.text += self._tok.decode(self._ids[self._prefix :])[len(done) :]
            self._prefix = self._read = len(self._ids)
        end = len(self.text) if final else len(self.text) - self._held()
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
