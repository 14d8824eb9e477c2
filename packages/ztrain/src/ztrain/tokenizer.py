"""A small byte-level BPE tokenizer (Hugging Face `tokenizers`, Rust) trained on the plays.

Byte-level: every string encodes (no unknown token) and decode(encode(s)) == s.
`<|endoftext|>` is id 0 and separates plays in the token stream.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from zcore.checkpoint import atomic_write

EOT = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 2048
# Bump when the training recipe below changes, so cached tokenizers are retrained.
RECIPE_VERSION = 1


class Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` with the ids as plain lists."""

    def __init__(self, hf: HFTokenizer) -> None:
        eot = hf.token_to_id(EOT)
        if eot is None:
            raise ValueError(f"tokenizer has no {EOT!r} special token")
        self.hf = hf
        self.eot_id: int = eot

    @property
    def vocab_size(self) -> int:
        """Ids are in [0, vocab_size), special tokens included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodes in parallel (Rust threads)."""
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def to_str(self) -> str:
        """The `tokenizer.json` text."""
        return self.hf.to_str()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write `tokenizer.json` atomically."""
        atomic_write(path, lambda f: f.write(self.to_str().encode()))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Read a `tokenizer.json`."""
        return cls(HFTokenizer.from_file(str(path)))

    @classmethod
    def from_str(cls, text: str) -> Tokenizer:
        return cls(HFTokenizer.from_str(text))


def train(texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` ids (256 bytes + merges + `<|endoftext|>`)."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size {vocab_size} < 257 (256 byte tokens + {EOT})")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return Tokenizer(hf)


def train_or_load(
    cache_dir: str | os.PathLike[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    plays: list[tuple[str, str]] | None = None,
) -> Tokenizer:
    """The tokenizer of the training plays, trained once per corpus and vocabulary size.

    Cached as `cache_dir/tokenizer-<corpus hash>-v<vocab_size>.json`. `plays`
    defaults to `data.load_plays()`; only its training split is used. Training is
    deterministic, so ranks racing to fill the cache write identical files.
    """
    from ztrain.data import corpus_hash, load_plays, split_plays

    plays = load_plays() if plays is None else plays
    train_plays, _ = split_plays(plays)
    cache = Path(cache_dir)
    path = cache / f"tokenizer-{corpus_hash(train_plays)}-r{RECIPE_VERSION}-v{vocab_size}.json"
    if path.is_file():
        return Tokenizer.load(path)
    tokenizer = train([text for _, text in train_plays], vocab_size)
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save(path)
    return tokenizer
