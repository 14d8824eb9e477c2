"""ALST's sequence tiling: the loss and the MLP computed a tile of tokens at a time.

For a long sequence the largest activations are not attention's (torch's sdpa keeps
``O(S)``) but the logits (``S x vocab``, float32, kept for the softmax's backward) and the
MLP's ``S x intermediate`` products. :func:`tiled_loss` computes the next-token loss one tile
of tokens at a time under activation checkpointing, so only one tile's logits ever exist
(in the forward, and again in the backward's recomputation); the full ``S x vocab`` matrix
never does. :func:`tile_mlp` runs an MLP the same way over tiles of the sequence. Both give
the untiled result up to float summation order, and work with or without ``cp`` (ALST's two
factors: the split over ranks and the tiling).

:func:`tile_causal_lm` applies both to a Hugging Face LLaMA-family causal LM: its forward
then returns the loss without logits when given labels.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE = -100


def _tile_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # (tile, vocab): the only logits alive at a time
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")


def tiled_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    shift_labels: torch.Tensor,
    num_items: torch.Tensor | float,
    tile_tokens: int,
) -> torch.Tensor:
    """``sum(cross_entropy(head(hidden), shift_labels)) / num_items`` over tiles of
    ``tile_tokens`` tokens: ``hidden`` ``(b, L, H)``, ``shift_labels`` ``(b, L)`` (``-100``:
    not counted). Only one ``(tile, vocab)`` logits block is alive at a time."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = shift_labels.reshape(-1).to(flat.device)
    total = flat.new_zeros((), dtype=torch.float32)
    for lo in range(0, flat.shape[0], tile_tokens):
        hi = lo + tile_tokens
        total = total + checkpoint(_tile_sum, head, flat[lo:hi], labels[lo:hi], use_reentrant=False)
    return total / num_items


def tile_mlp(mlp: nn.Module, tile_tokens: int) -> nn.Module:
    """Make ``mlp`` (``(b, L, H) -> (b, L, H)``, token-wise) run over tiles of
    ``tile_tokens`` positions, each checkpointed: its ``L x intermediate`` products exist one
    tile at a time. Returns ``mlp``."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    inner: Callable[[torch.Tensor], torch.Tensor] = mlp.forward

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] <= tile_tokens:
            return inner(x)
        tiles = x.split(tile_tokens, dim=1)
        return torch.cat([checkpoint(inner, t, use_reentrant=False) for t in tiles], dim=1)

    mlp.forward = types.MethodType(forward, mlp)  # type: ignore[method-assign]
    return mlp


def tile_causal_lm(
    model: nn.Module, *, loss_tile: int = 1024, mlp_tile: int | None = 1024
) -> nn.Module:
    """Tile ``model`` (a transformers LLaMA-family ``*ForCausalLM``: ``model.model`` the
    decoder, ``model.lm_head`` the head, each layer's ``mlp``): the loss over ``loss_tile``
    tokens at a time and every layer's MLP over ``mlp_tile`` positions (None: untiled).
    Composes with :func:`zcore.sequence.hf.parallelize` in either order. Returns ``model``."""
    decoder, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    layers = getattr(decoder, "layers", None)
    if decoder is None or head is None or layers is None:
        raise ValueError(
            f"{type(model).__name__} is not a LLaMA-family causal LM (model.model.layers and "
            "model.lm_head); tile its loss with zcore.sequence.tiling.tiled_loss directly"
        )
    if mlp_tile is not None:
        for layer in layers:
            tile_mlp(layer.mlp, mlp_tile)
    output_cls = getattr(sys.modules[type(model).__module__], "CausalLMOutputWithPast", None)

    def forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | float | None = None,
        **kwargs: Any,
    ) -> Any:
        kwargs.pop("logits_to_keep", None)
        kwargs.setdefault("use_cache", False)
        hidden = decoder(input_ids=input_ids, **kwargs).last_hidden_state
        if labels is None:
            logits = head(hidden)
            return output_cls(logits=logits) if output_cls else {"logits": logits}
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        if num_items_in_batch is None:
            num_items_in_batch = (shift_labels != IGNORE).sum()
        loss = tiled_loss(hidden, head, shift_labels, num_items_in_batch, loss_tile)
        return output_cls(loss=loss) if output_cls else {"loss": loss}

    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]
    return model
