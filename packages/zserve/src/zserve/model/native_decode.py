"""A decode step's layers on znative's kernels, every argument but the activations prepared once.

The per-op native forward (:meth:`zserve.model.llama.LlamaModel.forward` with ``native``)
calls one kernel per op but still pays Python around each: it re-takes each weight's numpy
view per call, allocates every op's output and routes each projection anew. cProfile of a
bf16 SmolLM2 batch-1 decode step counted ~580 ``Tensor.numpy()`` calls, ~670 ``view`` calls
and ~150 ``torch.empty`` a step; the engine's own timing put ~4.5 ms of a ~12 ms step in
Python between the kernels. :class:`DecodeProgram` takes the numpy views of every weight
once (after :func:`zserve.model.native.pack_on_huge_pages` moved them), keeps one set of
activation buffers per step size (1 .. :data:`~zserve.model.native.LINEAR_MAX_ROWS` rows)
and runs a layer as 8 kernel calls and 2 small torch ops on them (SwiGLU's
``silu(gate) * up``), with no allocation but silu's: each residual add is fused into the norm
that follows it (``znative.add_rms_norm``, the same float operations in the same order).

It runs the same kernels on the same arguments in the same order as the per-op path, so
the hidden states are bit-identical (``tests/zserve/model/test_native_decode.py``, atol 0).
A step it does not cover (a prompt chunk, more rows than the buffers, a bias, a Mixtral
layer, a bf16 model's zquant layers, which run as torch modules) takes the per-op path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

import znative
from zserve.model import native
from zserve.model.attention import AttentionPlan
from zserve.model.native import HostArray, np_view
from zserve.model.quantized_bound import BoundLinear

if TYPE_CHECKING:
    from zserve.kv_cache import KVCache
    from zserve.model.llama import LlamaModel

#: ``(kernel, weight-side args, keyword args)``: ``kernel(x, *args, out, **kwargs)`` writes
#: ``x (T, in)`` through a projection into ``out (T, out)``.
KernelCall = tuple[Any, tuple[Any, ...], dict[str, Any]]


def kernel_call(weight: Any, dtype: torch.dtype) -> tuple[KernelCall, int] | None:
    """The kernel call of a projection and its row limit (:func:`native.kernel_rows`, the
    per-op path's routing rule), or None where the per-op path would not call one kernel
    (a module with torch ops inside, a mismatched dtype)."""
    rows = native.kernel_rows(weight, dtype)
    if not rows:
        return None
    if isinstance(weight, torch.Tensor) and weight.is_contiguous():
        return (znative.linear_rows, (np_view(weight),), {}), rows
    if isinstance(weight, BoundLinear) and dtype == torch.float32:  # its rule for a call
        return weight.kernel_call(), min(rows, weight.call_rows)
    call = getattr(weight, "kernel_call", None)  # a wrapper over one (zserve.tp.quantized)
    if call is not None and dtype == torch.float32:
        wrapped: KernelCall | None = call()
        return None if wrapped is None else (wrapped, rows)
    return None


@dataclass
class _Layer:
    """One decoder layer's weight-side arguments."""

    input_norm: HostArray
    post_norm: HostArray
    qkv: KernelCall
    o: KernelCall
    gate_up: KernelCall
    down: KernelCall


class _Buffers:
    """The activations of a step of ``t`` tokens: torch tensors and their numpy views."""

    def __init__(
        self,
        t: int,
        hidden: int,
        qkv: int,
        q: int,
        heads: int,
        pad: tuple[int, int],
        d: int,
        inter: int,
        dtype: torch.dtype,
    ) -> None:
        def buf(*shape: int) -> tuple[torch.Tensor, HostArray]:
            x = torch.empty(*shape, dtype=dtype)
            return x, np_view(x)

        self.x, self.x_np = buf(t, hidden)
        self.h, self.h_np = buf(t, hidden)
        self.tmp, self.tmp_np = buf(t, hidden)
        self.qkv, self.qkv_np = buf(t, qkv)
        before, after = pad
        slots = before + heads + after  # a tp shard's empty slots make its KV groups whole
        self.o, self.o_np = buf(t, slots, d)
        q_view = self.qkv[:, :q].view(t, heads, d)
        # (copy, source) pairs run each layer: q into the attention's slots, where one token's
        # q is not a contiguous slice of its qkv row or there are empty slots; the attention's
        # output out of them, where there are
        self.q_copy: tuple[torch.Tensor, torch.Tensor] | None = None
        self.o_copy: tuple[torch.Tensor, torch.Tensor] | None = None
        if before or after:
            padded = torch.zeros(t, slots, d, dtype=dtype)  # the empty slots stay zero
            self.q_copy = (padded[:, before : before + heads], q_view)
            self.q_np = np_view(padded)
            rows = torch.empty(t, q, dtype=dtype)
            self.o_copy = (rows.view(t, heads, d), self.o[:, before : before + heads])
            self.o_rows_np = np_view(rows)
        else:
            if not q_view.is_contiguous():
                self.q_copy = (torch.empty_like(q_view), q_view)
            self.q_np = np_view(q_view if self.q_copy is None else self.q_copy[0])
            self.o_rows_np = np_view(self.o.view(t, q))
        self.gu, self.gu_np = buf(t, 2 * inter)
        self.gate, self.up = self.gu[:, :inter], self.gu[:, inter:]
        self.act, self.act_np = buf(t, inter)


class DecodeProgram:
    """A :class:`~zserve.model.llama.LlamaModel`'s decode steps as direct kernel calls."""

    def __init__(self, model: LlamaModel, layers: list[_Layer], max_rows: int, inter: int) -> None:
        self.model = model
        self.views = model.host_views
        """The model's numpy views of its long-lived tensors and of the KV cache blocks."""
        self.layers = layers
        self.max_rows = max_rows
        self.inter = inter
        self._buffers: dict[int, _Buffers] = {}

    @classmethod
    def build(cls, model: LlamaModel) -> DecodeProgram | None:
        """The program of ``model``, whose layers' MLPs are all ``DenseMLP`` (the caller's
        check: a Mixtral layer's experts are torch ops), or None off the native path or when
        a layer has a bias, a projection not on a single kernel, or an MLP narrower than
        another's (a pruned directory's)."""
        if not model.native:
            return None
        dtype = model.cos.dtype
        layers, max_rows, widths = [], native.LINEAR_MAX_ROWS, set()
        for w in model.layers:
            mlp: Any = w.mlp
            if any(b is not None for b in (w.qkv_bias, w.o_bias, mlp.gate_up_bias, mlp.down_bias)):
                return None
            calls = [kernel_call(m, dtype) for m in (w.qkv, w.o, mlp.gate_up, mlp.down)]
            if any(c is None for c in calls):
                return None
            max_rows = min(max_rows, *(rows for _, rows in calls))  # type: ignore[misc]
            widths.add(_out_features(mlp.gate_up) // 2)
            qkv, o, gate_up, down = (call for call, _ in calls)  # type: ignore[misc]
            layers.append(
                _Layer(np_view(w.input_norm), np_view(w.post_norm), qkv, o, gate_up, down)
            )
        if len(widths) != 1:
            return None
        return cls(model, layers, max_rows, widths.pop())

    def covers(self, plan: AttentionPlan) -> bool:
        """Whether every token of ``plan`` is a 1-token chunk and there are few enough."""
        t = plan.num_tokens
        return 0 < t <= self.max_rows and not plan.prefills and plan.decode_rows.numel() == t

    def _rows(self, t: int) -> _Buffers:
        b = self._buffers.get(t)
        if b is None:
            c = self.model.config
            b = _Buffers(
                t,
                c.hidden_size,
                c.q_size + 2 * c.kv_size,
                c.q_size,
                c.num_attention_heads,
                c.attention_pad,
                c.head_dim,
                self.inter,
                self.model.cos.dtype,
            )
            self._buffers[t] = b
        return b

    def run(self, token_ids: torch.Tensor, plan: AttentionPlan, kv_cache: KVCache) -> torch.Tensor:
        """The hidden states ``(T, hidden)`` after the last layer (a buffer of this program,
        overwritten by the next step of as many tokens), the keys and values written."""
        m, c = self.model, self.model.config
        b = self._rows(plan.num_tokens)
        torch.index_select(m.embed, 0, token_ids, out=b.x)
        views, eps, scale = self.views, c.rms_norm_eps, m.scale
        positions, slots, blocks, lens = native.plan_arrays(plan)
        cos, sin = views("cos", m.cos), views("sin", m.sin)
        heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x, x_np, h_np, tmp, tmp_np = b.x, b.x_np, b.h_np, b.tmp, b.tmp_np
        rms, add_rms, rotary, attend = (
            znative.rms_norm,
            znative.add_rms_norm,
            znative.rotary_kv_write,
            znative.paged_decode_attention,
        )
        stream, reduce = m.stream, m.reduce
        for i, w in enumerate(self.layers):
            if stream is not None:
                stream.acquire(i)
            k_np, v_np = views(("k", i), kv_cache.keys[i]), views(("v", i), kv_cache.values[i])
            if i:  # the previous layer's MLP output added to the residual stream
                add_rms(x_np, tmp_np, w.input_norm, h_np, eps=eps)
            else:
                rms(x_np, w.input_norm, h_np, eps=eps)
            kernel, args, kw = w.qkv
            kernel(h_np, *args, b.qkv_np, **kw)
            rotary(
                b.qkv_np,
                cos,
                sin,
                positions,
                slots,
                k_np,
                v_np,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=d,
            )
            if b.q_copy is not None:
                b.q_copy[0].copy_(b.q_copy[1])
            attend(b.q_np, k_np, v_np, blocks, lens, b.o_np, scale=scale)
            if b.o_copy is not None:
                b.o_copy[0].copy_(b.o_copy[1])
            kernel, args, kw = w.o
            kernel(b.o_rows_np, *args, tmp_np, **kw)
            if reduce is not None:  # tensor parallel: the heads' partial sums
                reduce(tmp)
            add_rms(x_np, tmp_np, w.post_norm, h_np, eps=eps)
            kernel, args, kw = w.gate_up
            kernel(h_np, *args, b.gu_np, **kw)
            torch.mul(F.silu(b.gate), b.up, out=b.act)
            kernel, args, kw = w.down
            kernel(b.act_np, *args, tmp_np, **kw)
            if reduce is not None:
                reduce(tmp)
            if stream is not None:
                stream.release(i)
        if self.layers:
            x += tmp  # the last layer's (the others' are added by the next layer's norm)
        return x


def _out_features(weight: Any) -> int:
    """Output rows of a projection: a matrix's first dimension or a layer's ``out_features``."""
    return int(weight.shape[0] if isinstance(weight, torch.Tensor) else weight.out_features)
