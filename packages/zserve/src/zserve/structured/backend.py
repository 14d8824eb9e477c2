"""llguidance behind zserve's structured output: one `GrammarBackend` per tokenizer, one
`GrammarMatcher` per constrained request.

Why llguidance: a Rust library with no Python dependencies (vLLM, SGLang and llama.cpp
use it) that reads the model's own ``tokenizer.json``, so it sees exactly the tokens the
model does; special tokens (``<|im_end|>``...) are never allowed inside JSON text. A mask
takes about a millisecond for SmolLM2's 49k tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from zserve.structured.spec import GrammarSpec


class GrammarMatcher:
    """The state of one request's grammar: which tokens may come next, and whether the
    value is complete."""

    def __init__(self, matcher: object, vocab_size: int) -> None:
        self._m = matcher
        self._vocab = vocab_size

    def allowed(self, width: int) -> torch.Tensor:
        """(width,) bool: the tokens the grammar allows next. Logits wider than the
        tokenizer's vocabulary (padded embedding tables) get the extra ids disallowed."""
        bias = self._m.compute_logit_bias()  # one byte per token: 0 or 200
        mask = torch.frombuffer(bytearray(bias), dtype=torch.uint8) != 0
        if mask.numel() >= width:
            return mask[:width]
        return torch.cat([mask, torch.zeros(width - mask.numel(), dtype=torch.bool)])

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token; RuntimeError if the grammar did not allow it
        (the mask makes that a bug, not a user error)."""
        if not self._m.consume_token(token_id):
            raise RuntimeError(f"token {token_id} broke the grammar: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """The value is complete and nothing may follow it: the request ends here."""
        return bool(self._m.is_stopped())


class GrammarBackend:
    """Compiles `GrammarSpec`s for one tokenizer (read from its ``tokenizer.json``; the
    set-up takes ~0.4 s, once per engine, on the first constrained request)."""

    def __init__(self, tokenizer_json: str | Path, eos_token_ids: Iterable[int]) -> None:
        import llguidance
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_json))
        eos = sorted(set(eos_token_ids))
        if not eos:
            raise ValueError(
                f"structured output needs an EOS token; `{tokenizer_json}`'s model has none "
                "(set eos_token_id in generation_config.json)"
            )
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._tok = llguidance.LLTokenizer(tok.to_str(), n_vocab=self.vocab_size, eos_token=eos)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher of ``spec``; ValueError with llguidance's reason for a grammar
        it cannot compile."""
        import llguidance

        m = llguidance.LLMatcher(self._tok, spec.grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"{spec.kind}: the grammar does not compile: {m.get_error()}")
        return GrammarMatcher(m, self.vocab_size)
