"""znative's zserve kernels against their readable torch references (zserve.model):
RMSNorm (`llama.rms_norm`), rotary + KV-cache write (`llama.apply_rotary` +
`KVCache.write`) and paged decode attention (`attention.paged_attention_reference`),
in float32 and bfloat16, at every SIMD level the CPU has; bad input is refused before
anything is written.

Tolerances: RMSNorm and rotary round like the reference (bf16 intermediates included), so
they differ only by the order of RMSNorm's sum of squares: 1e-6 relative in fp32, one bf16
ulp (2^-8 relative) in bf16; rotary is exact. Attention accumulates in f32 in another order
than the reference: 2e-6 absolute in fp32, 1e-2 in bf16 (the output's own rounding).
"""

from __future__ import annotations

import pytest
import torch

import znative
from zserve.kv_cache import KVCache
from zserve.model import native
from zserve.model.attention import paged_attention_reference, plan_ragged_attention
from zserve.model.llama import apply_rotary, rms_norm

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(simd: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 100, generator=g) * 3).to(dtype)
    w = (torch.rand(100, generator=g) + 0.5).to(dtype)
    got, want = native.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)
    rtol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kv_write_matches_reference(simd: str, dtype: torch.dtype) -> None:
    heads, kv_heads, d, bs, blocks, max_pos = 6, 2, 16, 4, 8, 40
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    ang = torch.arange(max_pos)[:, None] * 0.37 ** torch.arange(d // 2)[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    # Two sequences: a 3-token chunk at positions 9..11 and 2 tokens at 0..1.
    plan = plan_ragged_attention([3, 2], [9, 0], [[5, 1, 7], [2]], bs)
    ref_cache = KVCache(
        num_layers=1,
        num_blocks=blocks,
        block_size=bs,
        num_kv_heads=kv_heads,
        head_dim=d,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    cache = KVCache(
        num_layers=1,
        num_blocks=blocks,
        block_size=bs,
        num_kv_heads=kv_heads,
        head_dim=d,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    t = qkv.shape[0]
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    c, s = cos[plan.positions].unsqueeze(1), sin[plan.positions].unsqueeze(1)
    want = apply_rotary(qk, c, s)
    v = qkv[:, (heads + kv_heads) * d :].reshape(t, kv_heads, d)
    ref_cache.write(0, plan.slots, want[:, heads:], v)
    got = qkv.clone()
    native.rotary_kv_write_(got, cos, sin, plan, cache.keys[0], cache.values[0], heads, kv_heads)
    assert torch.equal(got[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d), want)
    assert torch.equal(cache.keys[0], ref_cache.keys[0])
    assert torch.equal(cache.values[0], ref_cache.values[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_matches_reference(simd: str, dtype: torch.dtype) -> None:
    heads, kv_heads, d, bs, blocks = 9, 3, 64, 16, 12
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
    # Decodes at positions 40, 0 and 17, mixed with a prompt chunk (rows 1..3).
    lens, starts = [1, 3, 1, 1], [40, 5, 0, 17]
    tables = [[3, 0, 9], [4], [7], [11, 2]]
    q = torch.randn(sum(lens), heads, d, generator=g).to(dtype)
    plan = plan_ragged_attention(lens, starts, tables, bs)
    out = torch.zeros_like(q)
    native.decode_attention_(out, q, k_cache, v_cache, plan, 0.125)
    want = paged_attention_reference(q, k_cache, v_cache, lens, starts, tables, 0.125)
    rows = plan.decode_rows
    atol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[rows].float(), want[rows].float(), rtol=0, atol=atol)
    assert not out[1:4].any()  # the prompt chunk's rows are not the decode kernel's


def test_bad_input_is_refused_and_nothing_written() -> None:
    k = torch.zeros(2, 4, 1, 8)
    q = torch.ones(1, 2, 8)
    out = torch.full_like(q, 7.0)
    tables = torch.tensor([[0, 5]])  # block 5 of 2
    lens = torch.tensor([6], dtype=torch.int32)
    with pytest.raises(ValueError, match="block id"):
        znative.paged_decode_attention(
            q.numpy(), k.numpy(), k.numpy(), tables.numpy(), lens.numpy(), out.numpy(), scale=1.0
        )
    assert torch.all(out == 7.0)
    with pytest.raises(TypeError, match="must all be float32 or all bfloat16"):
        znative.rms_norm(
            q.numpy(), native.np_view(torch.ones(8, dtype=torch.bfloat16)), out.numpy(), eps=1e-5
        )
    qkv = torch.ones(2, 32)  # (2 + 2 * 1) heads of 8
    cos = torch.ones(4, 8)
    pos, slots = torch.tensor([0, 1]), torch.tensor([3, 3])  # one slot written twice
    with pytest.raises(ValueError, match="slot"):
        znative.rotary_kv_write(
            qkv.numpy(),
            cos.numpy(),
            cos.numpy(),
            pos.numpy(),
            slots.numpy(),
            k.numpy(),
            k.numpy(),
            num_heads=2,
            num_kv_heads=1,
            head_dim=8,
        )
    assert torch.all(qkv == 1) and not k.any()  # refused before anything was written
