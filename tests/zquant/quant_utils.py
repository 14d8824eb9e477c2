"""Shared set-up of the PTQ/LKD/serialization tests: MiniLM once per process, real sentences,
and the fp32 reference embeddings every quantized variant is compared with."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from tests.utils.models import minilm_dir
from zquant.hf import load_model, load_tokenizer
from zquant.metrics import embedding_similarity, sentence_embeddings, sentences_from_text
from ztrain.data import load_plays, split_plays

EVAL_SENTENCES = 200


@functools.cache
def sentences(split: str, limit: int) -> tuple[str, ...]:
    """Real Shakespeare sentences: `val` from the held-out plays (evaluation), `train` from
    the others (calibration), so LKD is never scored on its own calibration text."""
    train, val = split_plays(load_plays())
    plays = train if split == "train" else val
    return tuple(sentences_from_text("\n".join(t for _, t in plays), limit=limit))


@functools.cache
def _minilm() -> nn.Module:
    return load_model(minilm_dir(), kind="encoder")


def minilm() -> nn.Module:
    """A fresh fp32 copy of all-MiniLM-L6-v2 (loaded from disk once per process)."""
    return copy.deepcopy(_minilm())


@functools.cache
def tokenizer():
    return load_tokenizer(minilm_dir())


@functools.cache
def reference() -> torch.Tensor:
    """fp32 embeddings of the evaluation sentences, (EVAL_SENTENCES, 384)."""
    return sentence_embeddings(_minilm(), tokenizer(), sentences("val", EVAL_SENTENCES))


def cosine(model: nn.Module) -> float:
    """Mean cosine similarity of `model`'s embeddings with the fp32 ones over 200 sentences."""
    return embedding_similarity(model, tokenizer(), sentences("val", EVAL_SENTENCES), reference())
