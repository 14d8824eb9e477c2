"""Ring attention in a Hugging Face LLaMA (``sequence_parallel_mode`` "ring"): the tiny
model with SmolLM2's 9 query / 3 key-value heads under ZeRO-3, each 11-token sequence split
over cp ranks, trains like one process on the whole sequence for 10 steps and saves back to
a directory transformers loads; at cp=4 (more ranks than key/value heads) with ALST's tiling.
Tolerances as in ``test_hf_ulysses`` (losses rtol 1e-5, weights 5e-5). Both are ``slow``: the
default suite covers the ring through ``tests/ztrain/test_train_cp_ring.py`` and
``test_ring_attention.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.zcore.sequence.test_hf_ulysses import check


@pytest.mark.slow(reason="2 ranks x 10 steps of a HF model under ZeRO-3: 25-60 s on 2 cores")
def test_cp2_ring_zero3_trains_like_one_process(tmp_path: Path) -> None:
    results = check(tmp_path, world=2, cp=2, tile=False, mode="ring")
    assert [r["data"] for r in results] == [(1, 0), (1, 0)]


@pytest.mark.slow(reason="4 ranks x 10 steps of a HF model: ~50 s on 2 cores")
def test_cp4_ring_above_the_kv_heads_trains_like_one_process(tmp_path: Path) -> None:
    results = check(tmp_path, world=4, cp=4, tile=True, mode="ring", timeout=300)
    assert [r["data"] for r in results] == [(1, 0)] * 4
