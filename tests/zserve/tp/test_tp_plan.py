"""zserve.tp.plan: every head count is cut (uneven splits, replicated KV heads), each rank's
MLP width is split evenly in aligned columns, and only tp > query heads is refused, naming the
numbers."""

from __future__ import annotations

import dataclasses

import pytest

from zserve.model.config import LlamaConfig
from zserve.tp.plan import MLP_ALIGN, TPPlanError, head_ranges, plan

# SmolLM2-135M's shape: 9 query heads, 3 KV heads, head_dim 64
SMOL = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
)


def test_smollm2_tp2_splits_query_heads_4_5_sharing_the_middle_kv_head() -> None:
    a, b = plan(SMOL, 2)  # the extra head goes to rank 1: rank 0 also schedules and samples
    # query heads 0-3 read KV heads 0-1 (3 + 1 of group 1's), 4-8 read 1-2: KV head 1 is held
    # (and cached) on both, each attending with the group's other heads' slots empty
    assert (a.kv_heads, a.q_heads) == ((0, 2), (0, 4))
    assert (b.kv_heads, b.q_heads) == ((1, 3), (4, 9))
    assert (a.config.num_attention_heads, a.config.num_key_value_heads) == (4, 2)
    assert (b.config.num_attention_heads, b.config.num_key_value_heads) == (5, 2)
    assert a.config.attention_pad == (0, 2) and b.config.attention_pad == (1, 0)
    assert a.config.attention_heads == b.config.attention_heads == 6
    # the MLP even: the all-reduce after the attention is a barrier, so extra MLP on rank 0
    # would not make up for rank 1's extra heads
    assert a.mlp == (0, 768) and b.mlp == (768, 1536)
    assert a.vocab == (0, 24576) and b.vocab == (24576, 49152)
    assert a.config.vocab_size == 49152  # the embedding stays whole


def test_query_heads_split_evenly_only_where_it_lightens_the_heaviest_rank() -> None:
    # q and o per query head, k and v per KV head: whole groups 1/2 of 3 KV heads weigh 8 and
    # 16 head blocks, 4/5 query heads over 2/2 KV heads 12 and 14
    assert head_ranges(9, 3, 2) == [((0, 4), (0, 2)), ((4, 9), (1, 3))]
    assert head_ranges(6, 3, 2) == [((0, 3), (0, 2)), ((3, 6), (1, 3))]
    # whole groups where they divide, or where an even split weighs as much (32/8 at tp 3)
    assert head_ranges(8, 2, 2) == [((0, 4), (0, 1)), ((4, 8), (1, 2))]
    assert head_ranges(9, 3, 3) == [((0, 3), (0, 1)), ((3, 6), (1, 2)), ((6, 9), (2, 3))]
    assert head_ranges(32, 8, 3) == [((0, 8), (0, 2)), ((8, 20), (2, 5)), ((20, 32), (5, 8))]


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5, 6, 9])
def test_every_head_and_column_is_held(tp: int) -> None:
    shards = plan(SMOL, tp)
    q = [h for s in shards for h in range(*s.q_heads)]
    assert q == list(range(9))  # each query head on exactly one rank, in order
    for s in shards:  # a rank's query heads read only its KV heads, and each of them
        group = 9 // 3
        assert {h // group for h in range(*s.q_heads)} == set(range(*s.kv_heads))
        c = s.config
        assert c.attention_heads % c.num_key_value_heads == 0
        before, after = c.attention_pad  # the empty slots fill out the groups the rank reads
        if c.num_key_value_heads > 1:
            assert s.q_heads[0] - before == s.kv_heads[0] * group
            assert s.q_heads[1] + after == s.kv_heads[1] * group
    cols = [m for s in shards for m in range(*s.mlp)]
    assert cols == list(range(1536))
    assert [v for s in shards for v in range(*s.vocab)] == list(range(49152))


@pytest.mark.parametrize("tp", [2, 3, 5, 7])
def test_mlp_cuts_are_aligned_and_even(tp: int) -> None:
    widths = [s.mlp[1] - s.mlp[0] for s in plan(SMOL, tp)]
    assert all(s.mlp[0] % MLP_ALIGN == 0 for s in plan(SMOL, tp))
    assert max(widths) - min(widths) <= MLP_ALIGN, widths
    aligned = plan(SMOL, 3, mlp_align=128)  # a quantized down projection's groups
    assert [s.mlp for s in aligned] == [(0, 512), (512, 1024), (1024, 1536)]


def test_more_ranks_than_kv_heads_replicate_them() -> None:
    # tp 4 over 3 KV heads: KV head 2 on ranks 2 and 3 (query heads 6 and 7-8)
    assert head_ranges(9, 3, 4) == [
        ((0, 3), (0, 1)),
        ((3, 6), (1, 2)),
        ((6, 7), (2, 3)),
        ((7, 9), (2, 3)),
    ]
    assert head_ranges(4, 1, 3) == [((0, 1), (0, 1)), ((1, 2), (0, 1)), ((2, 4), (0, 1))]


def test_tp_beyond_query_heads_is_refused_naming_both() -> None:
    with pytest.raises(TPPlanError, match=r"tp 10 > num_attention_heads 9.*--tp 9"):
        plan(SMOL, 10)


def test_mixtral_deals_whole_experts() -> None:
    moe = dataclasses.replace(
        SMOL, num_local_experts=8, num_experts_per_tok=2, model_type="mixtral"
    )
    shards = plan(moe, 3)
    assert [s.experts for s in shards] == [(0, 2), (2, 5), (5, 8)]
    assert all(s.mlp == (0, 1536) and s.config.num_local_experts == 8 for s in shards)
    with pytest.raises(TPPlanError, match=r"tp 9 > num_local_experts 8.*--tp 8"):
        plan(moe, 9)


def test_a_shard_config_must_fill_its_kv_groups() -> None:
    def shard(pad: tuple[int, int]) -> LlamaConfig:  # 5 query heads over 2 KV heads
        return dataclasses.replace(
            SMOL, num_attention_heads=5, num_key_value_heads=2, attention_pad=pad
        )

    assert shard((1, 0)).attention_heads == 6  # attending with a sixth, empty slot
    with pytest.raises(ValueError, match=r"num_attention_heads 5 is not a multiple of .* 2"):
        shard((0, 0))
    with pytest.raises(ValueError, match=r"num_attention_heads 5 \(\+ 2 empty slots\)"):
        shard((2, 0))
    with pytest.raises(ValueError, match=r"attention_pad \(-1, 2\) must be >= 0"):
        shard((-1, 2))
