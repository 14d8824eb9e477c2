from __future__ import annotations

from pathlib import Path

import pytest

from ztrain import tokenizer as tok
from ztrain.tokenizer import EOT, Tokenizer, train, train_or_load


def test_vocab_size_and_end_of_text(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 2048
    assert tokenizer.eot_id == 0
    assert tokenizer.encode(EOT) == [0]
    assert tokenizer.decode([0]) == EOT


def test_round_trip_on_play_text(tokenizer: Tokenizer, plays: list[tuple[str, str]]) -> None:
    for title, text in plays[:: len(plays) // 4]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text, title
        assert max(ids) < tokenizer.vocab_size
        # a 2048-id BPE on its own corpus: well over 2 characters per token
        assert len(text) / len(ids) > 2.3, title
    odd = "  O! what's this?\n\n\tCaf\u00e9 \u2014 \U0001f3ad 12345 [Exeunt]  "
    assert tokenizer.decode(tokenizer.encode(odd)) == odd


def test_training_is_deterministic_and_sized(plays: list[tuple[str, str]]) -> None:
    texts = [text for _, text in plays[:3]]
    a, b = train(texts, 400), train(texts, 400)
    assert a.to_str() == b.to_str()
    assert a.vocab_size == 400
    with pytest.raises(ValueError, match="vocab_size 100 < 257"):
        train(texts, 100)


def test_train_or_load_uses_the_cache(
    tokenizer: Tokenizer, plays, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (cached,) = cache_dir.glob("tokenizer-*-v2048.json")
    monkeypatch.setattr(tok, "train", lambda *a, **k: pytest.fail("retrained"))
    again = train_or_load(cache_dir, 2048, plays)
    assert again.to_str() == tokenizer.to_str()
    assert Tokenizer.load(cached).to_str() == tokenizer.to_str()


def test_save_load_round_trip(tokenizer: Tokenizer, tmp_path: Path) -> None:
    tokenizer.save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.load(tmp_path / "tokenizer.json")
    text = "KING LEAR:\nNothing will come of nothing: speak again.\n"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]
