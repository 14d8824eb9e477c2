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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zcore.comm import Comm
from zcore.sequence.heap import DEFAULT_THRESHOLD, fix_mmap_threshold

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
    tiles: int | None = None,
) -> torch.Tensor:
    """``sum(cross_entropy(head(hidden), shift_labels)) / num_items`` over tiles of about
    ``tile_tokens`` tokens: ``hidden`` ``(b, L, H)``, ``shift_labels`` ``(b, L)`` (``-100``:
    not counted). Only one ``(tile, vocab)`` logits block is alive at a time. ``tiles`` fixes
    the number of tiles (some may be empty): under ZeRO-3 each tile gathers the head's
    weight, so every rank must call it as often."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = shift_labels.reshape(-1).to(flat.device)
    n = tiles if tiles is not None else -(-flat.shape[0] // tile_tokens)
    total = flat.new_zeros((), dtype=torch.float32)
    for h, y in zip(flat.tensor_split(n), labels.tensor_split(n), strict=True):
        total = total + checkpoint(_tile_sum, head, h, y, use_reentrant=False)
    return total / num_items


def tile_mlp(
    mlp: nn.Module, tile_tokens: int, length: Callable[[int], int] | None = None
) -> nn.Module:
    """Make ``mlp`` (``(b, L, H) -> (b, L, H)``, token-wise) run over tiles of about
    ``tile_tokens`` positions, each checkpointed: its ``L x intermediate`` products exist one
    tile at a time. ``length(L)`` is the length the tile count comes from (default ``L``;
    :func:`tile_causal_lm` gives the longest slice across the ZeRO axis). Returns ``mlp``."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    inner: Callable[[torch.Tensor], torch.Tensor] = mlp.forward

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        n = -(-(length(x.shape[1]) if length else x.shape[1]) // tile_tokens)
        if n <= 1:
            return inner(x)
        tiles = x.tensor_split(n, dim=1)
        return torch.cat([checkpoint(inner, t, use_reentrant=False) for t in tiles], dim=1)

    mlp.forward = types.MethodType(forward, mlp)  # type: ignore[method-assign]
    return mlp


def tile_causal_lm(
    model: nn.Module,
    *,
    loss_tile: int = 1024,
    mlp_tile: int | None = 1024,
    mmap_threshold: int | None = DEFAULT_THRESHOLD,
) -> nn.Module:
    """Tile ``model`` (a transformers LLaMA-family ``*ForCausalLM``: ``model.model`` the
    decoder, ``model.lm_head`` the head, each layer's ``mlp``): the loss over ``loss_tile``
    tokens at a time and every layer's MLP over ``mlp_tile`` positions (None: untiled).
    Composes with :func:`zcore.sequence.hf.parallelize` in either order. Returns ``model``.

    Under ZeRO-3 every tile gathers its weights, so every rank of the ZeRO axis must run as
    many tiles: the engine binds the model to its mesh (``bind_mesh``) and each forward takes
    the tile counts from the longest sequence (slice) across that axis (a scalar all-reduce).

    ``mmap_threshold``: glibc's mmap threshold is held at this many bytes for the process
    (:func:`zcore.sequence.heap.fix_mmap_threshold`): the loss tiles' freed logits would
    otherwise raise it and leave the tiles' savings in a fragmented heap on a host (the
    resident set, not the live tensors, sets a CPU rank's memory). None: the allocator is
    left alone.
    """
    if mmap_threshold is not None and mmap_threshold < 1:
        raise ValueError(f"mmap_threshold is a positive byte count or None, got {mmap_threshold}")
    decoder, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    layers = getattr(decoder, "layers", None)
    if decoder is None or head is None or layers is None:
        raise ValueError(
            f"{type(model).__name__} is not a LLaMA-family causal LM (model.model.layers and "
            "model.lm_head); tile its loss with zcore.sequence.tiling.tiled_loss directly"
        )
    agreed: dict[str, Any] = {"comm": None, "length": 0}
    if mmap_threshold is not None:
        fix_mmap_threshold(mmap_threshold)

    def bind_mesh(mesh: Any) -> None:
        agreed["comm"] = mesh.comm("dp")

    if mlp_tile is not None:
        for layer in layers:
            tile_mlp(layer.mlp, mlp_tile, lambda _: int(agreed["length"]))
    output_cls = getattr(sys.modules[type(model).__module__], "CausalLMOutputWithPast", None)

    def forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | float | None = None,
        **kwargs: Any,
    ) -> Any:
        if input_ids is None:
            raise ValueError("a tiled causal LM takes input_ids (not inputs_embeds)")
        kwargs.pop("logits_to_keep", None)
        kwargs.setdefault("use_cache", False)
        agreed["length"] = _longest(input_ids.shape[1], agreed["comm"])
        hidden = decoder(input_ids=input_ids, **kwargs).last_hidden_state
        if labels is None:
            logits = head(hidden)
            return output_cls(logits=logits) if output_cls else {"logits": logits}
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        if num_items_in_batch is None:
            num_items_in_batch = (shift_labels != IGNORE).sum()
        tiles = -(-agreed["length"] * hidden.shape[0] // loss_tile)
        loss = tiled_loss(hidden, head, shift_labels, num_items_in_batch, loss_tile, tiles)
        return output_cls(loss=loss) if output_cls else {"loss": loss}

    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]
    model.bind_mesh = bind_mesh  # type: ignore[assignment]
    return model


def _longest(length: int, comm: Comm | None) -> int:
    """The longest of ``length`` across the ranks of ``comm``."""
    if comm is None or comm.size == 1:
        return length
    t = torch.tensor([length])
    comm.all_reduce(t, "tile count", dist.ReduceOp.MAX).wait()
    return int(t)
