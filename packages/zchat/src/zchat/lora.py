"""LoRA as DeepSpeed-Chat does it: chosen ``nn.Linear`` layers get a low-rank trainable side
path, so PPO can train only those (``only_optimize_lora``) and keep Adam state for them alone.

A converted layer computes ``y = x W^T + b + (x R L) * s`` with ``W [out, in]`` (and ``b``)
the original parameters, ``R [in, r]`` (``lora_right_weight``, Kaiming-uniform at init),
``L [r, out]`` (``lora_left_weight``, zero at init, so the layer starts equal to the plain
linear) and ``s = lora_scaling / r``. DeepSpeed-Chat's names and init; no dropout (theirs
defaults to 0). The layer keeps the very ``weight`` / ``bias`` Parameter objects of the
linear it replaces, so a ZeRO-3 partitioned weight stays partitioned and the new LoRA
parameters are partitioned by ``zcore.initialize`` like any others (each rank builds them;
the engine broadcasts rank 0's values).

Which layers: every ``nn.Linear`` whose qualified name contains one of the comma-separated
parts of ``module_name`` (DeepSpeed-Chat's ``*_lora_module_name`` matching). The served
(rollout) and saved weights are the merged ``W + s (R L)^T`` (:func:`merged_weight`,
:func:`merge_lora_`), so zserve and transformers see a plain model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Module):
    """A linear layer plus DeepSpeed-Chat's LoRA side path (see the module docstring)."""

    def __init__(self, linear: nn.Linear, lora_dim: int, lora_scaling: float = 1.0) -> None:
        super().__init__()
        if lora_dim <= 0:
            raise ValueError(f"lora_dim must be > 0, got {lora_dim}")
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.lora_dim = lora_dim
        self.lora_scaling = lora_scaling / lora_dim
        dtype = linear.weight.dtype
        right = torch.empty(self.in_features, lora_dim, dtype=dtype)
        # Kaiming-uniform with a = sqrt(5) over fan_in = in_features (nn.Linear's init of a
        # [r, in] matrix, stored transposed as DeepSpeed-Chat does)
        nn.init.kaiming_uniform_(right.T, a=math.sqrt(5))
        self.lora_right_weight = nn.Parameter(right)
        self.lora_left_weight = nn.Parameter(torch.zeros(lora_dim, self.out_features, dtype=dtype))
        self.lora_off = False
        """While true (:func:`lora_disabled`) the layer is the plain linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_off:
            return F.linear(x, self.weight, self.bias)
        side = (x @ self.lora_right_weight) @ self.lora_left_weight
        return F.linear(x, self.weight, self.bias) + side * self.lora_scaling

    def delta(self) -> torch.Tensor:
        """``s (R L)^T`` ``[out, in]``: what the side path adds to ``weight`` (full values:
        call inside a gather under ZeRO-3)."""
        return (self.lora_right_weight @ self.lora_left_weight).T * self.lora_scaling


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The LoRA layers of ``model`` by qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def convert_to_lora(
    model: nn.Module, module_name: str, lora_dim: int, key: str = "lora_module_name"
) -> list[str]:
    """Replace each matching ``nn.Linear`` of ``model`` by a :class:`LoRALinear` in place;
    returns the converted names. ``key`` names the config key in the error raised when
    nothing matches (an untied LM head is a linear too: ``lm_head`` matches only if asked)."""
    parts = [p for p in module_name.split(",") if p]
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and any(p in n for p in parts)
    ]
    if not names:
        raise ValueError(
            f"`{key}` {module_name!r} matches no nn.Linear of {type(model).__name__} (its "
            "names look like "
            f"{next((n for n, m in model.named_modules() if isinstance(m, nn.Linear)), '?')!r}); "
            "DeepSpeed-Chat's default 'decoder.layers.' is OPT's; use 'layers.' for "
            "LLaMA-family models"
        )
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), lora_dim))
    return names


@contextlib.contextmanager
def lora_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block every LoRA layer of ``model`` is its plain linear: with the base
    frozen (``only_optimize_lora``) the model is then the one LoRA started from, which is how
    PPO gets the reference model's log-probabilities without a second copy of the weights."""
    layers = list(lora_modules(model).values())
    for layer in layers:
        layer.lora_off = True
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_off = False


def only_optimize_lora_(model: nn.Module) -> int:
    """Freeze every parameter but the LoRA ones (DeepSpeed-Chat's ``only_optimize_lora``);
    returns the number of trainable elements left."""
    trainable = 0
    for name, p in model.named_parameters():
        keep = name.endswith(("lora_right_weight", "lora_left_weight"))
        p.requires_grad_(keep)
        trainable += p.numel() if keep else 0
    return trainable


def merged_weight(layer: LoRALinear) -> torch.Tensor:
    """A new ``[out, in]`` tensor ``W + s (R L)^T`` (full values: gather first under ZeRO-3)."""
    with torch.no_grad():
        return layer.weight.detach() + layer.delta().to(layer.weight.dtype)


def merge_lora_(model: nn.Module) -> int:
    """Fold every LoRA layer into its weight and put a plain ``nn.Linear`` (holding the same
    Parameter objects) back in its place, so the model saves and loads as the original
    architecture; returns how many were merged. Collective under ZeRO-3 (each weight is
    gathered, edited on rank 0 and re-partitioned)."""
    from zcore.zero.init import GatheredParameters

    layers = lora_modules(model)
    for name, layer in layers.items():
        params = [layer.weight, layer.lora_right_weight, layer.lora_left_weight]
        with GatheredParameters(params, modifier_rank=0), torch.no_grad():
            layer.weight.add_(layer.delta().to(layer.weight.dtype))
        plain = nn.Linear(
            layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta"
        )
        plain.weight, plain.bias = layer.weight, layer.bias
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, plain)
    return len(layers)
