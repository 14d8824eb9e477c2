"""Random-LTD's token routing: which tokens a layer keeps, and moving them out and back.

Shapes (batch-major; ``seq_batch_dim`` layers are transposed around these calls)::

    x      (B, T, C)  the hidden states entering a layer
    idx    (B, K)     int64, per sample K distinct positions in increasing order
    part   (B, K, C)  x at idx: what the layer runs on
    out    (B, T, C)  x with the layer's output for part written back at idx

Keeping the positions sorted is what lets a decoder layer stay causal on the subset: kept
token i attends to the kept tokens at or before it, as it would in the full sequence.

:func:`gather_reference` / :func:`scatter_reference` are the readable torch definitions
(``torch.gather`` and an out-of-place ``scatter``, differentiated by autograd).
:func:`gather_tokens` / :func:`scatter_tokens` are what the layers call: on CPU the
flattened ``index_select`` / ``index_copy_`` over (B*T, C) rows, on CUDA the ``random_ltd.cu``
kernels when CuPy is present; each is an autograd function whose backward is the other's
copy. No native CPU kernel: these are memory-bound row copies, and on a loaded 2-core box
``torch.gather``/``scatter`` measured from 0.4x to 1.5x the time of this form depending on
the shape (noise-level either way), a step of the bench's model costs thousands of times
more than one gather+scatter, so a Rust copy had nothing to win (``benchmarks/_random_ltd.py``
reports both forms at the run's shape).
"""

from __future__ import annotations

from typing import Any

import torch


def sample_indices(
    batch: int,
    seq_len: int,
    keep: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, keep) int64: per sample, ``keep`` distinct positions of ``seq_len`` drawn
    uniformly without replacement, in increasing order."""
    if not 1 <= keep <= seq_len:
        raise ValueError(f"random-LTD keeps {keep} of {seq_len} tokens; need 1 <= keep <= T")
    scores = torch.rand(batch, seq_len, device=device, generator=generator)
    return scores.argsort(dim=1)[:, :keep].sort(dim=1).values


def gather_reference(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """part[b, k] = x[b, idx[b, k]] (torch.gather; autograd gives the backward)."""
    return torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def scatter_reference(x: torch.Tensor, part: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x with out[b, idx[b, k]] = part[b, k] (out of place; autograd gives the backward)."""
    return x.scatter(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]), part)


def _flat(idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(B*K,) row numbers of the kept tokens in x viewed as (B*T, C)."""
    offsets = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1) * seq_len
    return (idx + offsets).reshape(-1)


def _cuda_kernels(x: torch.Tensor) -> bool:
    if not x.is_cuda or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    from zcore.data_efficiency import token_routing_cuda

    return token_routing_cuda.available()


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    if _cuda_kernels(x):
        from zcore.data_efficiency.token_routing_cuda import gather

        return gather(x, idx)
    B, T, C = x.shape
    return x.reshape(B * T, C).index_select(0, _flat(idx, T)).view(B, idx.shape[1], C)


def _scatter_(out: torch.Tensor, part: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Write part into out (B, T, C) at idx, in place; returns out."""
    if _cuda_kernels(out):
        from zcore.data_efficiency.token_routing_cuda import scatter_

        return scatter_(out, part, idx)
    B, T, C = out.shape
    out.view(B * T, C).index_copy_(0, _flat(idx, T), part.reshape(-1, C))
    return out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.shape = x.shape
        return _gather(x.contiguous(), idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (idx,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.shape)
        return _scatter_(out, grad.contiguous(), idx), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, part: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(idx)
        return _scatter_(x.contiguous().clone(), part.contiguous(), idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (idx,) = ctx.saved_tensors
        grad = grad.contiguous()
        grad_part = _gather(grad, idx)
        # the kept rows were overwritten by part, so x gets no gradient there
        grad_x = _scatter_(grad.clone(), torch.zeros_like(grad_part), idx)
        return grad_x, grad_part, None


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(B, T, C), (B, K) -> (B, K, C): the kept tokens; equals :func:`gather_reference`."""
    return _Gather.apply(x, idx)


def scatter_tokens(x: torch.Tensor, part: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x with part written back at idx; equals :func:`scatter_reference`."""
    return _Scatter.apply(x, part, idx)


def gather_mask(mask: torch.Tensor, idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    """An attention mask cut to the kept tokens: its last dim (keys) and, when it has one of
    length T, its second-to-last (queries), per sample. A batch-1 mask is broadcast first.
    Covers HF's (B, 1, T, T) causal and (B, 1, 1, T) padding masks and a (B, T) one."""
    B, K = idx.shape
    if mask.shape[0] == 1 and B > 1:
        mask = mask.expand(B, *mask.shape[1:])
    if mask.dim() == 2:
        return torch.gather(mask, 1, idx) if mask.shape[1] == seq_len else mask
    lead = [1] * (mask.dim() - 2)
    if mask.shape[-1] == seq_len:
        index = idx.view(B, *lead, K).expand(*mask.shape[:-1], K)
        mask = torch.gather(mask, -1, index)
    if mask.shape[-2] == seq_len:
        index = idx.view(B, *lead[:-1], K, 1).expand(*mask.shape[:-2], K, mask.shape[-1])
        mask = torch.gather(mask, -2, index)
    return mask


def gather_positions(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """A per-token tensor (B or 1, T, ...) (position ids, rotary cos/sin) at the kept tokens."""
    B, K = idx.shape
    if t.shape[0] == 1 and B > 1:
        t = t.expand(B, *t.shape[1:])
    index = idx.view(B, K, *[1] * (t.dim() - 2)).expand(B, K, *t.shape[2:])
    return torch.gather(t, 1, index)
