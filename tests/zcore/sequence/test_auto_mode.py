"""``sequence_parallel_mode`` "auto" (the default): Ulysses where the query heads divide over
cp, ring attention where they do not and the local attention is plain softmax attention
(``ring_ok``), Ulysses otherwise. At cp=2 ``DistributedAttention(mode="auto")`` equals full
attention for both choices (1e-5 in fp32, as ``test_distributed_attention``); the Hugging
Face batch hook keeps the zig-zag positions when the ring runs and consecutive slices when
Ulysses does (attention dropout, which the ring does not take, keeps Ulysses)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.utils.distributed import run_ranks
from tests.zcore.sequence.test_distributed_attention import CASES, _ranks, assert_full_attention
from zcore.sequence import DistributedAttention, RingLayout
from zcore.sequence.attention import configure_modes
from zcore.sequence.hf import _SliceBatch, _State


def test_auto_picks_by_the_head_split_and_the_layout() -> None:
    auto = DistributedAttention(lambda *a: None, mode="auto", ring_ok=True)
    assert auto.active_mode(9, 2) == "ring" and auto.active_mode(8, 2) == "ulysses"
    assert auto.active_mode(3, 3) == "ulysses" and auto.active_mode(4, 3) == "ring"
    assert auto.active_mode(8, 2, RingLayout.zigzag(16, 2)) == "ring"
    assert auto.active_mode(9, 2, RingLayout.consecutive([6, 5])) == "ring"
    own = DistributedAttention(lambda *a: None, mode="auto")  # its local attention may mask
    assert own.active_mode(9, 2) == "ulysses"
    for mode in ("ulysses", "ring"):
        fixed = DistributedAttention(lambda *a: None, mode=mode, ring_ok=True)
        assert fixed.active_mode(9, 2) == fixed.active_mode(8, 2) == mode


def test_auto_config_keeps_a_chosen_mode_and_sets_the_others() -> None:
    model = nn.ModuleDict(
        {
            "chosen": DistributedAttention(lambda *a: None, mode="ulysses"),
            "free": DistributedAttention(lambda *a: None),
        }
    )
    configure_modes(model, "auto")
    assert model["chosen"].mode == "ulysses" and model["free"].mode == "auto"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_auto_cp2_equals_full_attention(causal: bool) -> None:
    per_rank = run_ranks(_ranks, 2, args=(causal, "auto"))
    auto = DistributedAttention(lambda *a: None, mode="auto", ring_ok=True)
    modes = [auto.active_mode(hq, 2) for hq, _, _ in CASES]
    assert modes == ["ring", "ulysses", "ulysses", "ring"]  # 9, 4, 2 and 1 query heads
    assert_full_attention(per_rank, causal)


class _Attention(nn.Module):
    """What the batch hook reads of a transformers attention layer."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.head_dim = 1, 2
        self.q_proj = nn.Linear(4, heads * 2)


@pytest.mark.parametrize(
    ("heads", "dropout", "kept"),
    [(9, 0.0, [3, 4, 5, 6, 7, 8]), (8, 0.0, [6, 7, 8, 9, 10]), (9, 0.1, [6, 7, 8, 9, 10])],
    ids=["9-heads-ring", "8-heads-ulysses", "dropout-ulysses"],
)
def test_hf_batch_hook_follows_the_auto_choice(heads: int, dropout: float, kept: list) -> None:
    place = SimpleNamespace(rank=1, size=2)
    state = _State(DistributedAttention(lambda q, k, v: q, place, mode="auto", ring_ok=True))
    config = SimpleNamespace(sliding_window=None, attention_dropout=dropout)
    model = nn.Sequential(_Attention(heads))
    ids = torch.arange(100, 111)[None]  # 11 tokens: zig-zag chunks 3, 3, 3, 2
    _, out = _SliceBatch(place, state, config)(model, (), {"input_ids": ids})
    assert out["position_ids"].tolist() == [kept] and state.q_heads == heads


@pytest.mark.slow(reason="2 ranks x 10 steps of a HF model under ZeRO-3: 25-60 s on 2 cores")
def test_hf_cp2_auto_zero3_tiled_trains_like_one_process(tmp_path: Path) -> None:
    from tests.zcore.sequence.test_hf_ulysses import check

    results = check(tmp_path, world=2, cp=2, tile=True, mode="auto")  # 9 heads: the ring
    assert [r["data"] for r in results] == [(1, 0), (1, 0)]
