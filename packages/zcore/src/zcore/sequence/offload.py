"""ALST's third piece: activation checkpoints kept in host memory.

With every layer checkpointed, what a long sequence leaves on the device between the
forward and the backward is each layer's input (``layers x sequence x hidden``: the other
activations are recomputed). :func:`host_checkpoint` is torch's non-reentrant
``checkpoint`` whose saved inputs go through :func:`keep_on_host`: a tensor on an
accelerator is copied to host memory (pinned, the copy queued on the compute stream) when
the forward saves it and copied back when the backward's recomputation reads it, so the
device holds no layer input between the passes. :func:`checkpoint_layers` checkpoints a list
of layers that way (a Hugging Face decoder's ``model.model.layers``, z train's GPT blocks).

On a CPU the layer inputs are already in host memory: nothing is copied and nothing is
saved beyond what checkpointing itself saves. This is the reading chosen for a CPU run: the
same script runs on both, checkpointing applies on both, and the offload frees device
memory only where there is a device (``offload_saves`` says which). Spilling to disk is
not done here.

Results equal plain checkpointing bit for bit: the copies are exact and the recomputation
runs the same kernels on the same values.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_CACHES = frozenset(("past_key_values", "past_key_value", "cache", "layer_past"))
_Packed = torch.Tensor | tuple[torch.device, torch.Tensor]


def _pack(t: torch.Tensor) -> _Packed:
    if t.device.type == "cpu":
        return t  # host memory already: keep the tensor itself, no copy
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)  # ordered on the compute stream before any reuse
    return (t.device, host)


def _unpack(packed: _Packed) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)


@contextlib.contextmanager
def keep_on_host() -> Iterator[None]:
    """Tensors autograd saves inside this context are kept in host memory (see the
    module doc); tensors already there are kept as they are."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


def offload_saves(device: torch.device | str) -> bool:
    """Whether keeping checkpoints on the host frees memory for a model on ``device``."""
    return torch.device(device).type != "cpu"


def host_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``
    with the inputs it keeps for the recomputation in host memory. Tensor ``kwargs`` are
    kept the same way (passed to the checkpoint as inputs); other ``kwargs`` are closed
    over. A signature transformers' layers accept as ``_gradient_checkpointing_func``."""
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    rest = {k: v for k, v in kwargs.items() if k not in names}
    n = len(args)

    def run(*inputs: Any) -> Any:
        return function(*inputs[:n], **rest, **dict(zip(names, inputs[n:], strict=True)))

    with keep_on_host():
        return checkpoint(run, *args, *(kwargs[k] for k in names), use_reentrant=False)


def checkpoint_layers(layers: Iterable[nn.Module], *, offload: bool = True) -> None:
    """Checkpoint every module of ``layers``: its ``forward`` runs under
    :func:`host_checkpoint` (``offload``) or plain non-reentrant checkpointing. Module hooks
    (ZeRO-3's gathers) stay outside the checkpoint, as in transformers' own layer
    checkpointing; the submodules' run again in the recomputation. Only while training
    with gradients on (a KV cache argument is then dropped, as transformers does):
    evaluation runs the layer as it is."""
    keep = host_checkpoint if offload else functools.partial(checkpoint, use_reentrant=False)
    for layer in layers:
        if getattr(layer, "_z_checkpointed", None) is not None:
            raise ValueError(
                f"{type(layer).__name__} is checkpointed already "
                f"(offload={layer._z_checkpointed}); checkpoint each layer once"
            )
        inner = layer.forward

        def forward(self: nn.Module, *args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if not (self.training and torch.is_grad_enabled()):
                return _inner(*args, **kwargs)
            for cache in _CACHES.intersection(kwargs):
                kwargs[cache] = None  # the recomputation would write a KV cache twice
            return keep(_inner, *args, **kwargs)

        layer.forward = types.MethodType(forward, layer)  # type: ignore[method-assign]
        layer._z_checkpointed = offload  # type: ignore[assignment]
