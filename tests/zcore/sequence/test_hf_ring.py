"""Ring attention in a Hugging Face LLaMA (``sequence_parallel_mode`` "ring"): the tiny
model with SmolLM2's 9 query / 3 key-value heads under ZeRO-3, each 11-token sequence split
over cp ranks, trains like one process on the whole sequence for 10 steps and saves back to
a directory transformers loads; at cp=4 (more ranks than key/value heads) with ALST's tiling.
Tolerances as in ``test_hf_ulysses`` (losses rtol 1e-5, weights 5e-5). Both are ``slow``: the
default suite covers the ring through ``tests/ztrain/test_train_cp_ring.py`` and
``test_ring_attention.py``, and here the positions each rank keeps: the zig-zag layout for
the ring (chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``), consecutive slices for Ulysses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.zcore.sequence.test_hf_ulysses import check
from zcore.sequence import DistributedAttention, RingLayout
from zcore.sequence.hf import _SliceBatch, _State


class _Place:
    """The two numbers the batch hook reads of its ``cp`` Comm."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


@pytest.mark.parametrize(
    ("mode", "rank", "kept"), [("ring", 1, [3, 4, 5, 6, 7, 8]), ("ulysses", 1, [6, 7, 8, 9, 10])]
)
def test_each_rank_keeps_its_layout_positions(mode: str, rank: int, kept: list[int]) -> None:
    place = _Place(rank, 2)
    state = _State(DistributedAttention(lambda q, k, v: q, place, mode=mode))
    config = type("Config", (), {"sliding_window": None})()
    ids = torch.arange(100, 111)[None]  # 11 tokens: zig-zag chunks 3, 3, 3, 2
    _, out = _SliceBatch(place, state, config)(
        torch.nn.Identity(), (), {"input_ids": ids, "labels": ids}
    )
    assert out["position_ids"].tolist() == [kept]
    assert out["input_ids"].tolist() == [[100 + p for p in kept]]
    assert out["labels"].tolist() == [[101 + p if p < 10 else -100 for p in kept]]
    want = RingLayout.zigzag(11, 2) if mode == "ring" else RingLayout.consecutive([6, 5])
    assert state.layout == want and state.seq_lens == want.lens


@pytest.mark.slow(reason="2 ranks x 10 steps of a HF model under ZeRO-3: 25-60 s on 2 cores")
def test_cp2_ring_zero3_trains_like_one_process(tmp_path: Path) -> None:
    results = check(tmp_path, world=2, cp=2, tile=False, mode="ring")
    assert [r["data"] for r in results] == [(1, 0), (1, 0)]


@pytest.mark.slow(reason="4 ranks x 10 steps of a HF model: ~50 s on 2 cores")
def test_cp4_ring_above_the_kv_heads_trains_like_one_process(tmp_path: Path) -> None:
    results = check(tmp_path, world=4, cp=4, tile=True, mode="ring", timeout=300)
    assert [r["data"] for r in results] == [(1, 0)] * 4
