"""The LLaMA-family decoder (and Mixtral) in plain torch, over packed (ragged) tokens.

Weights are read straight from ``*.safetensors`` (one file, or shards listed by
``model.safetensors.index.json``) without transformers (:mod:`zserve.model.checkpoint`).
Per layer the q/k/v and the gate/up projections are concatenated into one matrix each
(:mod:`zserve.model.weights`), so a layer is four GEMMs over all packed tokens of the
forward; only attention looks at sequence boundaries. A `z quantize` directory loads the
same way, its quantized projections as zquant modules over the native kernels
(:mod:`zserve.model.quantized`). A Mixtral layer swaps the MLP for the sparse experts of
:mod:`zserve.model.mixtral`.

The math follows transformers' ``LlamaForCausalLM`` op for op (RMSNorm in fp32,
rotary tables in fp32 cast to the model dtype, ``rotate_half`` convention), which is
what the logits-equivalence tests hold it to.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Self

import torch
import torch.nn.functional as F

from zserve.kv_cache import KVCache
from zserve.model import native
from zserve.model.attention import AttentionPlan, ragged_paged_attention
from zserve.model.checkpoint import (
    Checkpoint,
    SafetensorsCheckpoint,
    TensorCheckpoint,
    WeightsMismatchError,
)
from zserve.model.config import LlamaConfig
from zserve.model.native_decode import DecodeProgram
from zserve.model.quantized_bound import BoundLinear
from zserve.model.weights import DenseMLP, LayerWeights, Linear, WeightLoader, linear, load_layer

if TYPE_CHECKING:
    from zserve.offload import LayerStream, OffloadSpec

# The checkpoint readers lived here; their import path stays.
__all__ = [
    "AttentionFn",
    "LlamaModel",
    "SafetensorsCheckpoint",
    "TensorCheckpoint",
    "WeightsMismatchError",
    "apply_rotary",
    "rms_norm",
]

#: ``(q, k, v, k_cache, v_cache, plan, scale) -> out``, as :func:`ragged_paged_attention`.
AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, float],
    torch.Tensor,
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LLaMA RMSNorm: normalise in fp32, scale in the input dtype (as transformers does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (T, heads, d)`` by ``cos``/``sin`` ``(T, 1, d)`` (``rotate_half`` layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaModel:
    """A LLaMA-family causal LM whose forward runs a ragged batch over a paged KV cache."""

    def __init__(
        self,
        config: LlamaConfig,
        checkpoint: Checkpoint,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        offload: OffloadSpec | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        c = config
        h = c.hidden_size
        load = WeightLoader(checkpoint, dtype, device)
        self.quantization = load.quantized
        """The quantized layers served (a zquant directory), else None."""
        self.embed = load("model.embed_tokens.weight", c.vocab_size, h)
        head = None if load.quantized is None else load.quantized.head(c.vocab_size, h)
        self.lm_head: Linear
        if head is not None:  # quantized on its own (`z quantize --lm-head int8`)
            self.lm_head = head
        elif c.tie_word_embeddings and "lm_head.weight" not in checkpoint:
            self.lm_head = self.embed
        else:
            self.lm_head = load("lm_head.weight", c.vocab_size, h)
        self.norm = load("model.norm.weight", h)
        self.reduce: Callable[[torch.Tensor], object] | None = None
        """Sums a row-parallel projection's partial output ``(T, hidden)`` across the
        tensor-parallel ranks in place (:mod:`zserve.tp`), after o and after the MLP; None:
        the whole model is here."""
        self.stream: LayerStream | None = None
        """The decoder layers beyond ``offload``'s weight budget, streamed through slots
        (:mod:`zserve.offload`); None: every layer resident."""
        self.layers: list[LayerWeights]
        if offload is None:
            self.layers = [load_layer(load, c, i) for i in range(c.num_hidden_layers)]
        else:
            from zserve.offload import load_layers

            self.layers, self.stream = load_layers(
                lambda i: load_layer(load, c, i), c.num_hidden_layers, offload, checkpoint.model_dir
            )
        # Rotary tables for every position, fp32 like transformers, then the model dtype.
        inv_freq = c.inv_freq()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, head_dim)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.scale = c.head_dim**-0.5
        self.native = native.available(device, dtype)
        """Whether RMSNorm, rotary + cache write and decode attention run on znative's
        kernels (:mod:`zserve.model.native`; CPU, fp32/bf16), else on torch ops. RMSNorm
        and rotary give the torch ops' bits exactly (a `z quantize` directory's INT8
        activation codes, hence its perplexity, must not move from `z eval`'s)."""
        self.project = native.linear if self.native else linear
        """Plain projections over a decode step's few rows on ``znative.linear_rows``."""
        for layer in self.layers:
            if isinstance(layer.mlp, DenseMLP):
                layer.mlp.project = self.project
        if self.native and not isinstance(checkpoint, TensorCheckpoint):
            self._pack_weights()  # handed-over weights (zchat's hybrid engine) stay shared
        self._kernel_rows = self._rows_on_kernels()
        self.host_views = native.HostViews()
        """The numpy views of the tensors every native forward reads (rotary tables, norm
        weights, KV cache blocks), taken once; shared by the per-op path and the program."""
        dense = all(isinstance(layer.mlp, DenseMLP) for layer in self.layers)
        self.decode_program = DecodeProgram.build(self) if self.native and dense else None
        """Decode steps as direct kernel calls on views taken here, after the packing
        (:mod:`zserve.model.native_decode`); None: every step takes the per-op path."""

    def _rows_on_kernels(self) -> tuple[int, int]:
        """(tokens, logit rows) up to which every projection of a forward, and the LM head,
        run on znative's kernels (:func:`native.kernel_rows`, the rule :func:`native.linear`
        routes by; Mixtral's torch-op experts are capped like a plain matrix); (0, 0) off
        the native path."""
        if not self.native:
            return 0, 0
        dtype = self.cos.dtype

        def rows(owner: object, name: str) -> int:
            return native.kernel_rows(
                getattr(owner, name), dtype, getattr(owner, name + "_bias", None)
            )

        *body, head = self._projections()
        layer_rows = min(rows(*slot) for slot in body)
        if not all(isinstance(layer.mlp, DenseMLP) for layer in self.layers):
            # Mixtral's experts are torch ops: small at a decode step's few rows.
            layer_rows = min(layer_rows, native.LINEAR_MAX_ROWS)
        return layer_rows, rows(*head)

    def step_threads(self, tokens: int, logit_rows: int) -> AbstractContextManager[None]:
        """Where a forward of ``tokens`` tokens and ``logit_rows`` logit rows runs all its
        projections on znative's kernels, torch single-threaded around it
        (:func:`native.torch_single_threaded`): the kernels bring their own threads, and
        torch's OpenMP worker, woken by the small ops between them, spins on the core they
        need. A W4 SmolLM2 (INT8 head, 2 cores, ``ZNATIVE_NUM_THREADS=2``): a 64-token
        prefill 200-260 ms with 2 torch threads, 120-150 with 1; the decode steps after it
        13-17 ms, 10-12 ms. Else torch keeps its threads (its GEMMs run the larger steps)."""
        layer_rows, head_rows = self._kernel_rows
        return native.torch_single_threaded(tokens <= layer_rows and logit_rows <= head_rows)

    def _pack_weights(self) -> None:
        """The plain projection matrices and the LM head (a zquant directory's: the INT8/INT4
        codes of its layers) in one buffer on huge pages, in the order a forward reads them
        (:func:`native.pack_on_huge_pages`): ~1.3x a decode step's weight read rate on one
        thread. A tied head stays the embedding table."""
        tied = self.lm_head is self.embed
        slots: list[tuple[object, str]] = []
        bound: list[BoundLinear] = []  # a zquant directory's layers: their codes
        streamed = [] if self.stream is None else self.stream.order
        skip = {id(self.layers[i]) for i in streamed} | {id(self.layers[i].mlp) for i in streamed}
        for owner, name in self._projections():
            if id(owner) in skip:  # bound to its streaming slot
                continue
            w = getattr(owner, name)
            if isinstance(w, BoundLinear):
                bound.append(w)
                slots.append((w.layer, "qdata"))
            else:
                slots.append((owner, name))
        native.pack_on_huge_pages(slots)
        for b in bound:
            b.bind()  # views of the moved codes
        if tied and isinstance(self.lm_head, torch.Tensor):
            self.embed = self.lm_head  # one table, not a second copy beside the head's

    def _projections(self) -> list[tuple[object, str]]:
        """``(owner, attribute)`` of every projection weight, in the order a forward reads
        them, the LM head last."""
        slots: list[tuple[object, str]] = []
        for layer in self.layers:
            slots += [(layer, "qkv"), (layer, "o")]
            if isinstance(layer.mlp, DenseMLP):
                slots += [(layer.mlp, "gate_up"), (layer.mlp, "down")]
        return [*slots, (self, "lm_head")]

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_positions: int | None = None,
    ) -> Self:
        """Load ``config.json`` and the safetensors weights of ``model_dir``."""
        config = LlamaConfig.from_dir(model_dir)
        return cls(
            config,
            SafetensorsCheckpoint(model_dir),
            dtype=dtype,
            device=torch.device(device),
            max_positions=max_positions or config.max_position_embeddings,
        )

    # no_grad, not inference_mode: the logits leave the forward and samplers may edit
    # them in place, which inference tensors forbid outside inference mode.
    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,
        plan: AttentionPlan,
        kv_cache: KVCache,
        logit_rows: torch.Tensor,
        attention: AttentionFn = ragged_paged_attention,
    ) -> torch.Tensor:
        """Run the packed tokens ``token_ids (T,)``; fp32 logits ``(len(logit_rows), vocab)``.

        Writes every token's key/value to ``kv_cache`` at ``plan.slots``.
        """
        norm = native.rms_norm if self.native else rms_norm
        program = self.decode_program
        if (
            self.native
            and program is not None
            and attention is native.ragged_paged_attention_native
            and program.covers(plan)
        ):
            x = program.run(token_ids, plan, kv_cache)
        else:
            x = self._layers_per_op(token_ids, plan, kv_cache, attention)
        # Only the rows whose logits are wanted go through the final norm and the LM head.
        x = norm(x.index_select(0, logit_rows), self.norm, self.config.rms_norm_eps)
        if not isinstance(self.lm_head, torch.Tensor):  # a quantized head: a zquant module
            return self.lm_head(x).float()
        head = native.lm_head if self.native else F.linear
        return head(x, self.lm_head).float()

    def _layers_per_op(
        self,
        token_ids: torch.Tensor,
        plan: AttentionPlan,
        kv_cache: KVCache,
        attention: AttentionFn,
    ) -> torch.Tensor:
        """The hidden states ``(T, hidden)`` after the last layer, an op (or a kernel) a call."""
        c = self.config
        t = token_ids.numel()
        heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        before, after = c.attention_pad
        norm = native.rms_norm if self.native else rms_norm
        # index_select, not advanced indexing: the latter's parallel kernel stalls for
        # milliseconds on a CPU shared with other work (see attention._gather).
        x = self.embed.index_select(0, token_ids)  # (T, hidden)
        if self.native:  # numpy views of what every layer's kernels read, taken once
            views, arrays = self.host_views, native.plan_arrays(plan)
            cos, sin = views("cos", self.cos), views("sin", self.sin)
            on_kernel = attention is native.ragged_paged_attention_native
        else:
            cos = self.cos.index_select(0, plan.positions).unsqueeze(1)  # (T, 1, d)
            sin = self.sin.index_select(0, plan.positions).unsqueeze(1)
        stream = self.stream
        for i, w in enumerate(self.layers):
            if stream is not None:
                stream.acquire(i)
            k_cache, v_cache = kv_cache.keys[i], kv_cache.values[i]
            extra = {}
            if self.native:
                post_norm = views(("post_norm", i), w.post_norm)
                h = norm(x, views(("input_norm", i), w.input_norm), c.rms_norm_eps)
                k_np, v_np = views(("k", i), k_cache), views(("v", i), v_cache)
                if on_kernel:
                    extra = {"host": (k_np, v_np, arrays)}
            else:
                post_norm = w.post_norm
                h = norm(x, w.input_norm, c.rms_norm_eps)
            qkv = self.project(h, w.qkv, w.qkv_bias)  # (T, q + 2 kv)
            if self.native:  # rotary in place and the cache write, one kernel call
                qkv = qkv.contiguous()
                native.rotary_kv_write_(qkv, cos, sin, plan, k_np, v_np, heads, kv_heads, arrays)
                q = qkv[:, : c.q_size].view(t, heads, d)
                k = qkv[:, c.q_size : c.q_size + c.kv_size].view(t, kv_heads, d)
            else:
                # q and k heads rotate together: (T, heads + kv_heads, d).
                qk = qkv[:, : c.q_size + c.kv_size].view(t, heads + kv_heads, d)
                q, k = apply_rotary(qk, cos, sin).split((heads, kv_heads), dim=1)
            v = qkv[:, c.q_size + c.kv_size :].view(t, kv_heads, d)
            if not self.native:
                kv_cache.write(i, plan.slots, k, v)
            if before or after:  # a tp shard's empty slots make its KV groups whole
                q = F.pad(q, (0, 0, before, after))  # (T, attention_heads, d)
            o = attention(q, k, v, k_cache, v_cache, plan, self.scale, **extra)
            if before or after:
                o = o[:, before : before + heads]
            # in place: x is this forward's own (index_select's output), the sums as x + y's
            y = self.project(o.reshape(t, c.q_size), w.o, w.o_bias)
            if self.reduce is not None:
                self.reduce(y)
            x += y
            y = w.mlp(norm(x, post_norm, c.rms_norm_eps))
            if self.reduce is not None:
                self.reduce(y)
            x += y
            if stream is not None:
                stream.release(i)
        return x
