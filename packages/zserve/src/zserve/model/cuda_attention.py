"""The paged-attention decode kernel (``znative/cuda/kernels/paged_attention.cu``) for torch.

:func:`paged_attention_decode` runs one query token per sequence against the blocked
KV cache on the GPU; :func:`ragged_paged_attention_cuda` is a drop-in for
:func:`zserve.model.attention.ragged_paged_attention` that sends the batch's 1-token
chunks (decodes) to the kernel and its prompt chunks to torch's SDPA. The kernel's
reference is :func:`zserve.model.attention.paged_attention_reference`.
"""

from __future__ import annotations

import torch

from znative.cuda import f32, i32
from zserve.model.attention import AttentionPlan, prefill_attention_

_KERNELS = {
    torch.float32: "paged_attention_decode_f32",
    torch.float16: "paged_attention_decode_f16",
    torch.bfloat16: "paged_attention_decode_bf16",
}
_THREADS = 128  # PA_THREADS in the .cu
MAX_HEAD_DIM = 256  # PA_MAX_HEAD_DIM in the .cu


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention on the GPU: ``q (B, H, d)`` → ``(B, H, d)`` in ``q``'s dtype.

    Args:
        q: one query token per sequence (any float dtype; computed in fp32).
        k_cache, v_cache: ``(num_blocks, block_size, kv_heads, d)``, fp32/fp16/bf16.
        block_tables: ``(B, max_blocks)`` physical block ids (padding is never read).
        context_lens: ``(B,)`` keys each query attends to (positions ``0 .. len - 1``).
        scale: softmax scale, usually ``d ** -0.5``.
    """
    import znative.cuda

    if not q.is_cuda:
        raise ValueError(f"paged_attention_decode needs CUDA tensors; q is on {q.device}")
    if k_cache.dtype not in _KERNELS or v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"KV cache dtype {k_cache.dtype}/{v_cache.dtype} unsupported; use one of "
            f"{sorted(str(d) for d in _KERNELS)} for both"
        )
    num_seqs, heads, d = q.shape
    _, block_size, kv_heads, d_cache = k_cache.shape
    if d_cache != d or d > MAX_HEAD_DIM or heads % kv_heads:
        raise ValueError(
            f"q (B, {heads}, {d}) does not fit the cache (…, {block_size}, {kv_heads}, "
            f"{d_cache}); head_dim must match and be <= {MAX_HEAD_DIM}, heads a multiple "
            "of kv_heads"
        )
    q32 = q.float().contiguous()
    out = torch.empty_like(q32)
    if num_seqs == 0:
        return out.to(q.dtype)
    kc, vc = k_cache.contiguous(), v_cache.contiguous()
    if kc.dtype != torch.float32:  # CuPy has no bf16: 16-bit patterns cross as int16
        kc, vc = kc.view(torch.int16), vc.view(torch.int16)
    tables = block_tables.to(device=q.device, dtype=torch.int32).contiguous()
    lens = context_lens.to(device=q.device, dtype=torch.int32).contiguous()
    znative.cuda.launch(
        "paged_attention",
        _KERNELS[k_cache.dtype],
        (heads, num_seqs),
        _THREADS,
        (
            out,
            q32,
            kc,
            vc,
            tables,
            lens,
            f32(scale),
            i32(heads),
            i32(kv_heads),
            i32(d),
            i32(block_size),
            i32(tables.shape[1]),
        ),
        stream=torch.cuda.current_stream(q.device).cuda_stream,
        device=q.device.index,
    )
    return out.to(q.dtype)


def ragged_paged_attention_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """:func:`~zserve.model.attention.ragged_paged_attention` with decodes on the kernel."""
    out = torch.empty_like(q)
    prefill_attention_(out, q, k, v, k_cache, v_cache, plan, scale)
    if plan.decode_rows.numel():
        out[plan.decode_rows] = paged_attention_decode(
            q[plan.decode_rows], k_cache, v_cache, plan.decode_blocks, plan.decode_lens, scale
        )
    return out
