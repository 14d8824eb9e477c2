"""A LLaMA-family model's weights as read from a checkpoint.

Per layer the q/k/v and the gate/up projections are concatenated into one matrix each
(:class:`LayerWeights`, :class:`DenseMLP`). :class:`WeightLoader` reads each tensor,
checked against its expected shape, onto the model's device and dtype; a `z quantize`
directory's quantized projections come as zquant modules (:mod:`zserve.model.quantized`),
and a Mixtral layer's feed-forward block is the sparse experts of :mod:`zserve.model.mixtral`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from zserve.model.checkpoint import Checkpoint
from zserve.model.config import LlamaConfig
from zserve.model.mixtral import SparseMoE
from zserve.model.quantized import QuantizedLinears, is_zquant_dir

#: A projection's weight: a ``(out, in)`` matrix, or a module ``(T, in) -> (T, out)`` that
#: holds its own bias (a zquant layer when the directory is a zquant one).
Linear = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


def linear(x: torch.Tensor, weight: Linear, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` through the projection ``weight`` (+ ``bias`` when it is a plain matrix)."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return weight(x)


class FeedForward(Protocol):
    """A layer's feed-forward block: ``(T, hidden)`` normed tokens to ``(T, hidden)``."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class DenseMLP:
    """LLaMA's SwiGLU MLP, gate/up fused: ``gate_up (2 I, hidden)``, ``down (hidden, I)``."""

    gate_up: Linear
    gate_up_bias: torch.Tensor | None
    down: Linear
    down_bias: torch.Tensor | None
    project: Callable[[torch.Tensor, Linear, torch.Tensor | None], torch.Tensor] = linear
    """How ``x`` goes through a projection: :func:`linear`, or :func:`native.linear`."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x, self.gate_up, self.gate_up_bias).chunk(2, dim=-1)
        return self.project(F.silu(gate) * up, self.down, self.down_bias)


@dataclass
class LayerWeights:
    """One decoder layer, q/k/v fused: ``qkv (q + 2 kv, hidden)``; ``mlp`` its feed-forward."""

    input_norm: torch.Tensor
    qkv: Linear
    qkv_bias: torch.Tensor | None
    o: Linear
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    mlp: FeedForward


class WeightLoader:
    """Reads checkpoint tensors, checked against their expected shapes, onto the model's
    device and dtype. A zquant directory (`z quantize`) gives its quantized layers as
    zquant modules (:mod:`zserve.model.quantized`, held in ``quantized``)."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.device = device
        self.quantized: QuantizedLinears | None = None
        if is_zquant_dir(checkpoint.model_dir):
            self.quantized = QuantizedLinears.open(checkpoint.model_dir, device)
            cut = getattr(checkpoint, "cut_quantized", None)  # a tensor-parallel rank's reader
            if cut is not None:
                self.quantized = cut(self.quantized)

    def __contains__(self, name: str) -> bool:
        return name in self.checkpoint

    def __call__(self, name: str, *shape: int) -> torch.Tensor:
        """The tensor ``name`` of shape ``shape``; :class:`~zserve.model.checkpoint.WeightsMismatchError` if not."""
        if self.quantized is not None:
            self.quantized.check_plain(name)
        t = self.checkpoint.get(name, shape)
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def cat(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        """The tensors ``names`` concatenated along dim 0 (one tensor: itself, not a copy)."""
        parts = [self(n, *s) for n, s in zip(names, shapes, strict=True)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def linear(
        self, prefixes: list[str], rows: list[int], cols: int, bias: bool
    ) -> tuple[Linear, torch.Tensor | None]:
        """The layers ``prefixes`` (each ``(rows[i], cols)``) as one projection, outputs
        concatenated: ``(weight, bias)``, the weight a matrix or a module holding its bias."""
        if self.quantized is not None:
            return self.quantized.linear(prefixes, rows, cols, bias, self), None
        w = self.cat([p + ".weight" for p in prefixes], [(r, cols) for r in rows])
        b = self.cat([p + ".bias" for p in prefixes], [(r,) for r in rows]) if bias else None
        return w, b

    def out_features(self, prefix: str, default: int) -> int:
        """Rows of the layer ``prefix``: ``default`` (config.json's), or a pruned zquant
        directory's stored width."""
        return default if self.quantized is None else self.quantized.out_features(prefix, default)


def load_layer(load: WeightLoader, config: LlamaConfig, index: int) -> LayerWeights:
    """Decoder layer ``index``'s weights, q/k/v and gate/up fused."""
    c, h = config, config.hidden_size
    p = f"model.layers.{index}."
    attn = [p + f"self_attn.{x}_proj" for x in "qkv"]
    ab = c.attention_bias
    input_norm = load(p + "input_layernorm.weight", h)
    qkv, qkv_bias = load.linear(attn, [c.q_size, c.kv_size, c.kv_size], h, ab)
    o, o_bias = load.linear([p + "self_attn.o_proj"], [h], c.q_size, ab)
    return LayerWeights(
        input_norm=input_norm,
        qkv=qkv,
        qkv_bias=qkv_bias,
        o=o,
        o_bias=o_bias,
        post_norm=load(p + "post_attention_layernorm.weight", h),
        mlp=load_mlp(load, config, p),
    )


def load_mlp(load: WeightLoader, config: LlamaConfig, prefix: str) -> FeedForward:
    """The feed-forward block of the layer whose tensors start with ``prefix``: the
    SwiGLU MLP, or Mixtral's experts when the config has ``num_local_experts``."""
    c = config
    if c.num_local_experts:
        return SparseMoE.load(load, prefix, c)
    h = c.hidden_size
    inter = load.out_features(prefix + "mlp.up_proj", c.intermediate_size)  # pruned: less
    names, bias = [prefix + "mlp.gate_proj", prefix + "mlp.up_proj"], c.mlp_bias
    gate_up, gate_up_bias = load.linear(names, [inter, inter], h, bias)
    down, down_bias = load.linear([prefix + "mlp.down_proj"], [h], inter, bias)
    return DenseMLP(gate_up, gate_up_bias, down, down_bias)
