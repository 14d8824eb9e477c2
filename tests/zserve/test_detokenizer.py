"""Incremental detokenization on the real SmolLM2 tokenizer: multi-byte characters
split over tokens, leading spaces, and stop-string hold-back."""

from __future__ import annotations

import pytest

from tests.utils.models import smollm2_dir
from zserve.detokenizer import IncrementalDetokenizer
from zserve.tokenizer import Tokenizer

TEXTS = [
    " To be, or not to be: that is the question.",
    " Café — naïve 日本語の文章 🙂🎭 done",
    "\n\nHAMLET:\n  Alas, poor Yorick!",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(smollm2_dir())


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_concatenate_to_the_full_decode(tok, text) -> None:
    prompt = tok.encode("Once upon a time")
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt)
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.delta())
    pieces.append(d.delta(final=True))
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_multibyte_tokens_wait_for_the_rest_of_the_character(tok) -> None:
    ids = tok.encode("🙂")
    assert len(ids) > 1 and tok.decode(ids[:1]).endswith("\ufffd")
    d = IncrementalDetokenizer(tok, [])
    d.add(ids[0])
    assert d.delta() == ""
    for t in ids[1:]:
        d.add(t)
    assert d.delta() == "🙂"


def test_stop_string_is_held_back_then_cut(tok) -> None:
    text = " The rest is silence. END of play"
    d = IncrementalDetokenizer(tok, tok.encode("x"), stop=["END"])
    out = []
    for t in tok.encode(text):
        d.add(t)
        out.append(d.delta())
        if d.stopped:
            break
    out.append(d.delta(final=True))
    assert d.stopped and "".join(out) == " The rest is silence. "


def test_partial_stop_match_is_released_when_it_does_not_complete(tok) -> None:
    d = IncrementalDetokenizer(tok, [], stop=["STOP"])
    deltas = []
    for t in tok.encode("a ST and STO then go"):
        d.add(t)
        deltas.append(d.delta())
    deltas.append(d.delta(final=True))
    assert not d.stopped and "".join(deltas) == "a ST and STO then go"


def test_chat_template_matches_transformers(tok) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir())
    for msgs in (
        [{"role": "user", "content": "Who wrote Hamlet?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ):
        want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(msgs) == want
    for text in TEXTS:
        assert tok.encode(text) == hf(text)["input_ids"]
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])
