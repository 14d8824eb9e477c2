"""Gather a ZeRO-3 actor's partitions into full tensors that zserve's runner serves as they are.

A ZeRO-3 parameter keeps only its rank's slot; ``GatheredParameters`` all-gathers the full
value into ``p.data`` and on exit sets ``p.data`` back to an empty tensor. Holding a reference
to the gathered value across that exit keeps it alive after the parameter is released: that
reference is what zserve's :class:`~zserve.runner.ModelRunner` gets (``weights=``), so the
actor's weights exist once, as the gather produced them, not copied into a second model.
(zserve fuses q/k/v and gate/up into one matrix each for its GEMMs; those two are built by
concatenation; the gathered pieces die as each layer is built, so the peak is the full
weights plus one layer's pieces.) Each parameter is its own all-gather, so that no served
tensor is a view that keeps a larger gather buffer alive.

Parameters at most the persistence threshold stay gathered in ZeRO-3 and are aliased too;
an actor that is not partitioned at all (one process, stage < 3) is aliased whole.

A LoRA actor (:mod:`zchat.lora`) is served merged: each LoRA layer's weight, right and left
matrices are gathered together and ``W + s (R L)^T`` is a new tensor under the weight's name
(the LoRA matrices themselves are not served), so zserve sees the plain architecture.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from zchat.lora import lora_modules, merged_weight
from zcore.zero import held_bytes
from zcore.zero.init import GatheredParameters


def gather_full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` by ``state_dict`` name, full (collective under ZeRO-3:
    every rank calls it). Tied parameters appear once, under their first name (for LLaMA
    ``model.embed_tokens.weight``; zserve then uses it as the LM head too). The returned
    tensors are detached, alias no live parameter storage of a partitioned weight, and
    stay valid after the partitions are released; drop them to free the memory."""
    out: dict[str, torch.Tensor] = {}
    lora = {id(m.weight): m for m in lora_modules(model).values()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lora_right_weight", "lora_left_weight")):
                continue
            layer = lora.get(id(p))
            if layer is not None:  # merged into a fresh tensor: nothing live is aliased
                parts = [p, layer.lora_right_weight, layer.lora_left_weight]
                with GatheredParameters(parts):
                    out[name] = merged_weight(layer)
                continue
            # one parameter per gather: a multi-parameter gather's values may be views of
            # one buffer, which aliasing one of them would keep whole
            with GatheredParameters([p]):
                out[name] = p.data.detach()
    return out


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tied or aliased one counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def resident_param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters' current ``.data`` (a released ZeRO-3 parameter holds none)
    plus their ZeRO-3 shards: the actor's own weight memory, outside any rollout."""
    return sum(held_bytes(p) for p in model.parameters())
