"""zserve's CPU forward on znative's kernels: RMSNorm, rotary + KV-cache write, decode
attention over the paged cache, each one call per layer instead of a chain of torch ops.

The profile of a batch-1 decode step on SmolLM2 (30 layers) showed the time outside the
GEMMs going to the paged gather (``index_select`` of the block tables), the masked SDPA
call of one query token, and ~25 small torch ops per layer (RMSNorm's seven, rotary's
five, the cache writes), each paying dispatch and thread-pool wake-ups. The kernels
(``zkernels::serve``, runtime SIMD dispatch) replace them:

* :func:`rms_norm` — ``znative.rms_norm``; reference :func:`zserve.model.llama.rms_norm`,
  whose bits it gives exactly: the squares are added in the order of torch's CPU sum
  kernel (summed in another order, the last bits moved a W8A8 model's INT8 activation
  codes and its served perplexity by 5e-3 relative from `z eval`'s).
* :func:`rotary_kv_write_` — ``znative.rotary_kv_write``: q/k heads of the fused ``qkv``
  rows rotated in place, keys and values written to their cache slots in the same pass;
  reference :func:`zserve.model.llama.apply_rotary` + :meth:`zserve.kv_cache.KVCache.write`.
* :func:`decode_attention_` — ``znative.paged_decode_attention``: each 1-token chunk's
  attention read straight through its block table (no gathered copy, no mask); reference
  :func:`zserve.model.attention.paged_attention_reference`, and
  :func:`zserve.model.attention.decode_attention_` is the torch path it replaces.

* :func:`linear` / :func:`lm_head` — ``znative.linear_rows`` for the projections and the
  LM head over the few rows of a decode step (float32 and bfloat16 matrices); reference
  ``F.linear`` (f32 accumulation, rounded once to bf16 on both sides; sums in another
  order, so within 2 bf16 ulps / ~1e-6 relative in fp32). At batch 1 each is a
  matrix-vector product bound by reading the weight, and torch's one-row path read it at
  about half the kernel's speed (SmolLM2's 49152 x 576 LM head: 9.9 ms vs 4.3 ms fp32,
  4.7 vs 2.3 ms bf16, one thread); the kernel streams the weight once for all rows.

They run on CPU tensors of float32 or bfloat16 (:func:`available`); ``ZSERVE_NATIVE=0``
turns them off (the torch path then runs, as on GPU or for other dtypes).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

import znative
from zserve.model.attention import AttentionPlan, prefill_attention_

DTYPES = (torch.float32, torch.bfloat16)

HostArray = Any
"""A numpy array (``Tensor.numpy()``'s; zserve does not import numpy itself)."""


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the native kernels serve a model on ``device`` in ``dtype``."""
    return (
        device.type == "cpu"
        and dtype in DTYPES
        and os.environ.get("ZSERVE_NATIVE", "1") != "0"
        and hasattr(znative, "paged_decode_attention")
    )


def np_view(t: torch.Tensor | HostArray) -> HostArray:
    """A numpy view (``Tensor.numpy()``) of a contiguous CPU tensor, bfloat16 as its int16
    bits, no copy; an array already taken (a long-lived tensor's, see :class:`HostViews`)
    as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


class HostViews:
    """The numpy views of a forward's long-lived tensors, taken once instead of at every
    kernel call (a decode step made ~810 ``Tensor.numpy()`` calls, 27 a layer, ~1 us
    each): the rotary tables and norm weights of a model, the key/value blocks of each
    layer of a KV cache, the index arrays of an :class:`AttentionPlan` (one per forward).
    Each view is retaken when its slot holds another tensor (a KV cache rebuilt), so a
    stale view is never used; a view keeps its tensor alive, so this lives no longer
    than the model that owns it."""

    def __init__(self) -> None:
        self._slots: dict[object, tuple[torch.Tensor, HostArray]] = {}

    def __call__(self, key: object, t: torch.Tensor) -> HostArray:
        """The view of ``t``, held under ``key`` until the slot gets another tensor."""
        hit = self._slots.get(key)
        if hit is None or hit[0] is not t:
            hit = (t, np_view(t))
            self._slots[key] = hit
        return hit[1]


def plan_arrays(plan: AttentionPlan) -> tuple[HostArray, ...]:
    """``(positions, slots, decode_blocks, decode_lens)`` of a CPU plan as numpy views."""
    return tuple(
        t.numpy() for t in (plan.positions, plan.slots, plan.decode_blocks, plan.decode_lens)
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor | HostArray, eps: float) -> torch.Tensor:
    """:func:`zserve.model.llama.rms_norm` of ``x (T, hidden)`` in one kernel call (``weight``
    may be its numpy view, taken before)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    znative.rms_norm(np_view(x), np_view(weight), np_view(out), eps=eps)
    return out


#: Rows up to which :func:`linear` runs on the kernel (decode steps); more go to torch.
LINEAR_MAX_ROWS = 4
#: Rows up to which a bfloat16 :func:`linear` runs on the kernel where znative's level is
#: below AVX-512 (an AVX2 CPU has no native bf16, and torch's bf16 GEMM there ran ~4x slower
#: than the kernel's rows at 16-64 rows, 2 cores; `benchmarks/results/serve-avx2.md`).
BF16_NO_AVX512_MAX_ROWS = 1 << 16


@contextmanager
def torch_single_threaded(active: bool) -> Iterator[None]:
    """torch's intra-op threads set to 1 inside the block when ``active`` (restored after).

    A decode step of at most :data:`LINEAR_MAX_ROWS` tokens spends its time in the native
    kernels, which run on znative's own team; torch's remaining ops there are small, but the
    largest (the sampler's reductions over the 49152-wide logits row) are past torch's grain
    size: its OpenMP worker wakes each step and then spins, which we take to be what kept
    the team's helper off the second core (not traced further; the measured decode rates:
    ``benchmarks/results/serve-decode-threads.md``). Prefill and batched steps keep torch's
    threads (their GEMMs are torch's)."""
    saved = torch.get_num_threads()
    if not active or saved == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def kernel_rows(weight: Any, dtype: torch.dtype, bias: torch.Tensor | None = None) -> int:
    """Rows up to which :func:`linear` of ``dtype`` activations through ``weight`` (+ ``bias``)
    runs on a znative kernel: a plain matrix of that dtype with no bias up to
    :data:`LINEAR_MAX_ROWS` (bfloat16 below AVX-512: :data:`BF16_NO_AVX512_MAX_ROWS`), a bound zquant layer up to its ``max_rows``, anything else
    (a module with torch ops inside) never."""
    if not isinstance(weight, torch.Tensor):
        return int(getattr(weight, "max_rows", 0))
    if bias is not None or weight.dtype != dtype or dtype not in DTYPES:
        return 0
    if dtype == torch.bfloat16 and znative.simd_level() != "avx512":
        return BF16_NO_AVX512_MAX_ROWS
    return LINEAR_MAX_ROWS


def linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x (M, K)``; on ``znative.linear_rows`` when the
    weight is a plain float32/bfloat16 matrix of ``x``'s dtype, there is no bias and
    ``0 < M <= LINEAR_MAX_ROWS`` (a decode step's rows), else torch's (a GEMM it does well).
    A ``weight`` that is a module (a zquant layer) is called as it is.

    At batch 1 every projection is a matrix-vector product bound by reading the weight;
    torch's one-row path read it at ~11 GB/s here (fp32 and bf16), the kernel at ~20-26.
    """
    if not isinstance(weight, torch.Tensor):
        return weight(x)  # type: ignore[no-any-return]
    if not 0 < x.shape[0] <= kernel_rows(weight, x.dtype, bias):  # 0 rows: no logits
        return torch.nn.functional.linear(x, weight, bias)
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    znative.linear_rows(np_view(x), np_view(weight.contiguous()), np_view(out))
    return out


def lm_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head ``x (M, hidden) -> (M, vocab)``: :func:`linear` without a bias."""
    return linear(x, weight)


#: Where :func:`pack_on_huge_pages` starts its buffer (a huge page) and aligns each tensor.
HUGE_PAGE, TENSOR_ALIGN = 2 << 20, 64


def pack_on_huge_pages(slots: Sequence[tuple[object, str]]) -> None:
    """Moves the CPU tensor ``getattr(owner, name)`` of every slot into one buffer, back to back
    in slot order (each start 64-byte aligned), on transparent huge pages where the kernel
    gives them; each old tensor is let go once its copy is made, so the peak is one matrix
    above the weights. Slots whose value is not a contiguous CPU tensor stay as they are.

    Why: a batch-1 decode step streams every weight matrix once, one thread reading memory
    front to back. torch's allocator takes 4 KiB pages, so the read crosses a page (a TLB
    miss, and the end of the hardware prefetcher's run) every 4 KiB; this buffer is an
    anonymous mapping advised ``MADV_HUGEPAGE`` (2 MiB pages where transparent huge pages
    are enabled or on ``madvise``). SmolLM2's 121 matrices of a decode step: 18.2 vs 13.9
    GB/s fp32, 15.8 vs 12.4 bf16 (one thread, same run, loaded machine). Without huge
    pages this is a plain copy into one buffer.
    """
    sizes = []
    for owner, name in slots:
        t = getattr(owner, name)
        ok = isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
        sizes.append(-(-t.numel() * t.element_size() // TENSOR_ALIGN) * TENSOR_ALIGN if ok else 0)
    if not any(sizes):
        return
    # Private: a shared anonymous mapping is shmem, which takes no transparent huge pages.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    buf = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=flags)  # committed as written
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # not Linux, or a kernel without THP: 4 KiB pages
        pass
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the mapping alive
    at = -flat.data_ptr() % HUGE_PAGE
    for (owner, name), size in zip(slots, sizes, strict=True):
        if size:
            old = getattr(owner, name)
            nbytes = old.numel() * old.element_size()
            new = flat[at : at + nbytes].view(old.dtype).view(old.shape)
            setattr(owner, name, new.copy_(old))
            at += size


def rotary_kv_write_(
    qkv: torch.Tensor,
    cos: torch.Tensor | HostArray,
    sin: torch.Tensor | HostArray,
    plan: AttentionPlan,
    k_cache: torch.Tensor | HostArray,
    v_cache: torch.Tensor | HostArray,
    num_heads: int,
    num_kv_heads: int,
    arrays: tuple[HostArray, ...] | None = None,
) -> None:
    """Rotate the q/k heads of ``qkv (T, (H + 2 KV) * d)`` in place by the full ``cos``/``sin``
    tables at ``plan.positions``; write k (rotated) and v to the caches at ``plan.slots``.
    ``cos``, ``sin`` and the caches may be numpy views taken before; ``arrays`` the plan's
    (:func:`plan_arrays`)."""
    d = cos.shape[-1]
    positions, slots, _, _ = plan_arrays(plan) if arrays is None else arrays
    znative.rotary_kv_write(
        np_view(qkv),
        np_view(cos),
        np_view(sin),
        positions,
        slots,
        np_view(k_cache),
        np_view(v_cache),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=d,
    )


def decode_attention_(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor | HostArray,
    v_cache: torch.Tensor | HostArray,
    plan: AttentionPlan,
    scale: float,
    arrays: tuple[HostArray, ...] | None = None,
) -> None:
    """Attention of the plan's 1-token chunks, read through their block tables, into ``out``
    (the caches may be numpy views taken before; ``arrays`` the plan's, :func:`plan_arrays`)."""
    n = plan.decode_rows.numel()
    if not n:
        return
    whole = n == plan.num_tokens  # every chunk a decode: rows are 0 .. T-1 in order
    q_d = q.contiguous() if whole else q.index_select(0, plan.decode_rows)
    o = out if whole else torch.empty_like(q_d)
    _, _, blocks, lens = plan_arrays(plan) if arrays is None else arrays
    znative.paged_decode_attention(
        np_view(q_d),
        np_view(k_cache),
        np_view(v_cache),
        blocks,
        lens,
        np_view(o),
        scale=scale,
    )
    if not whole:
        out.index_copy_(0, plan.decode_rows, o)


def ragged_paged_attention_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    host: tuple[HostArray, HostArray, tuple[HostArray, ...]] | None = None,
) -> torch.Tensor:
    """:func:`zserve.model.attention.ragged_paged_attention` with the decodes on the kernel
    (prompt chunks stay on torch SDPA, which is already one call per chunk). ``host``: the
    caches' numpy views and the plan's arrays (:func:`plan_arrays`), taken before."""
    out = torch.empty(q.shape, dtype=q.dtype)
    prefill_attention_(out, q, k, v, k_cache, v_cache, plan, scale)
    if host is None:
        decode_attention_(out, q, k_cache, v_cache, plan, scale)
    else:
        decode_attention_(out, q, host[0], host[1], plan, scale, host[2])
    return out
