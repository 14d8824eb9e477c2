"""Ragged paged attention: the CPU/torch fast path and the CUDA decode kernel against the
one-token-at-a-time reference, on random caches with scattered block tables."""

from __future__ import annotations

import random

import pytest
import torch

from zserve.model.attention import (
    paged_attention_reference,
    plan_ragged_attention,
    ragged_paged_attention,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 6, 2, 32, 4, 40
# (tokens in the chunk, start position): prompt chunks from 0 and after cached keys, decodes.
LAYOUT = [(9, 0), (1, 12), (5, 7), (1, 0), (1, 30), (3, 0), (2, 4)]


def make_batch(device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    free = random.Random(seed).sample(range(NUM_BLOCKS), NUM_BLOCKS)
    tables = []
    for n, start in LAYOUT:
        nb = -(-(start + n) // BLOCK)
        tables.append([free.pop() for _ in range(nb)] + [free.pop()])  # one spare block
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    total = sum(n for n, _ in LAYOUT)
    q = torch.randn((total, HEADS, HEAD_DIM), generator=g).to(device=device, dtype=dtype)
    lens, starts = [n for n, _ in LAYOUT], [s for _, s in LAYOUT]
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, lens=lens, starts=starts, tables=tables)


def run_fast(b: dict, attention=ragged_paged_attention) -> torch.Tensor:
    device = b["q"].device
    plan = plan_ragged_attention(b["lens"], b["starts"], b["tables"], BLOCK, device)
    flat = (-1, KV_HEADS, HEAD_DIM)
    k = b["k_cache"].view(flat)[plan.slots]  # the forward's own keys, as cached
    v = b["v_cache"].view(flat)[plan.slots]
    return attention(b["q"], k, v, b["k_cache"], b["v_cache"], plan, HEAD_DIM**-0.5)


def run_reference(b: dict) -> torch.Tensor:
    args = (b["q"], b["k_cache"], b["v_cache"], b["lens"], b["starts"], b["tables"])
    return paged_attention_reference(*args, HEAD_DIM**-0.5).float()


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_fast_path_matches_reference(dtype: torch.dtype, atol: float) -> None:
    b = make_batch("cpu", dtype)
    out = run_fast(b)
    assert out.shape == b["q"].shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), run_reference(b), atol=atol, rtol=0)


def test_plan_slots_follow_the_block_tables() -> None:
    plan = plan_ragged_attention([3, 1], [2, 5], [[7, 2], [4, 9]], 4)
    # Positions 2, 3 in block 7; 4 in block 2; position 5 of the second in block 9.
    assert plan.slots.tolist() == [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 9 * 4 + 1]
    assert plan.positions.tolist() == [2, 3, 4, 5]
    assert plan.decode_rows.tolist() == [3] and plan.decode_lens.tolist() == [6]
    assert plan.prefills[0].mask is not None and plan.prefills[0].mask.shape == (3, 5)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)]
)
def test_cuda_decode_kernel_matches_reference(dtype: torch.dtype, atol: float) -> None:
    from zserve.model.cuda_attention import paged_attention_decode

    g = torch.Generator().manual_seed(3)
    lens = [1, 3, 4, 5, 17, 64, 250]  # block edges, one key, a long context
    block, kv_heads, heads, d, num_blocks = 16, 3, 9, 64, 64
    free = random.Random(3).sample(range(num_blocks), num_blocks)
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens]
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    shape = (num_blocks, block, kv_heads, d)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn((len(lens), heads, d), generator=g)
    ref = paged_attention_reference(
        q, k_cache, v_cache, [1] * len(lens), [n - 1 for n in lens], tables, d**-0.5
    )
    out = paged_attention_decode(
        q.cuda(), k_cache.cuda(), v_cache.cuda(), padded.cuda(), torch.tensor(lens).cuda(), d**-0.5
    )
    torch.testing.assert_close(out.cpu(), ref, atol=atol, rtol=0)


@pytest.mark.gpu
@cuda
def test_cuda_ragged_attention_matches_reference() -> None:
    from zserve.model.cuda_attention import ragged_paged_attention_cuda

    b = make_batch("cuda", torch.float32)
    out = run_fast(b, ragged_paged_attention_cuda)
    torch.testing.assert_close(out.cpu(), run_reference(b).cpu(), atol=1e-5, rtol=0)
