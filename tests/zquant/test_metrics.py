"""The accuracy metrics on real models and real text: identical models score exactly 1 /
the same perplexity, a perturbed model scores lower, and bad input is rejected."""

from __future__ import annotations

import math

import pytest
import torch

from tests.utils.models import smollm2_dir
from tests.zquant.quant_utils import minilm, reference, sentences, tokenizer
from zquant.hf import load_model, load_tokenizer, model_kind
from zquant.metrics import (
    embedding_similarity,
    perplexity,
    sentence_embeddings,
    sentences_from_text,
)
from ztrain.data import load_plays, split_plays


def test_sentences_are_real_and_clean():
    text = split_plays(load_plays())[1][0][1]
    got = sentences_from_text(text, limit=250)
    assert len(got) == 250
    assert all(5 <= len(s.split()) <= 40 for s in got)
    assert not any("[" in s or s.isupper() for s in got)
    assert any("Caesar" in s for s in got)
    with pytest.raises(ValueError, match="min_words=5, max_words=2"):
        sentences_from_text(text, min_words=5, max_words=2)


def test_embedding_cosine_is_one_for_the_same_model_and_drops_with_noise():
    evals = sentences("val", 200)
    model = minilm()
    assert embedding_similarity(model, tokenizer(), evals, reference()) == pytest.approx(
        1.0, abs=1e-6
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.encoder.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    noisy = embedding_similarity(model, tokenizer(), evals, reference())
    assert 0.5 < noisy < 0.999


def test_embeddings_ignore_padding():
    model, tok = minilm(), tokenizer()
    one = sentence_embeddings(model, tok, ["To be, or not to be, that is the question."])
    padded = sentence_embeddings(
        model, tok, ["To be, or not to be, that is the question.", "Words " * 30]
    )[:1]
    torch.testing.assert_close(one, padded, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="reference has 3 rows for 2 sentences"):
        embedding_similarity(model, tok, ["a b", "c d"], torch.zeros(3, 384))


def test_smollm2_perplexity_on_held_out_play_is_sane():
    assert model_kind(smollm2_dir()) == "causal"
    model, tok = load_model(smollm2_dir()), load_tokenizer(smollm2_dir())
    text = split_plays(load_plays())[1][0][1]
    ppl = perplexity(model, tok, text, max_tokens=512, window=256)
    assert 5 < ppl < 200  # Shakespeare is hard for a 135M model, but far from uniform (49152)
    assert perplexity(model, tok, text, max_tokens=512, window=256) == ppl  # deterministic
    shuffled = " ".join(sorted(text.split()[:600]))
    assert perplexity(model, tok, shuffled, max_tokens=512, window=256) > ppl
    with pytest.raises(ValueError, match=r"fewer than one window of 256"):
        perplexity(model, tok, "Friends, Romans, countrymen.", window=256)
    assert math.isfinite(ppl)
