"""PEFT models under :class:`zcore.hf.Trainer`: only the adapter is optimised and saved.

A ``peft`` model (LoRA over a frozen base, at stage 3 a base built partitioned by
``zcore.hf.from_pretrained``) needs nothing special to train: the base's parameters are frozen
(``requires_grad=False``), so the engine's optimizer, gradient reduction and checkpoint
shards cover the adapter only, and the frozen base goes to the checkpoint's model state.
Saving writes what ``PeftModel.from_pretrained`` loads: the trainable (adapter) parameters are
gathered (stage 3) and rank 0 calls the model's own ``save_pretrained``, which keeps the
adapter's tensors. Nothing here imports peft or transformers: a PEFT model is recognised by
the class's module.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.distributed as dist
from torch import nn


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft`` model (``PeftModel`` and its task subclasses)."""
    return any(c.__module__.split(".")[0] == "peft" for c in type(model).__mro__)


def save_adapter(model: nn.Module, output_dir: str, is_main: bool) -> None:
    """Write ``model``'s adapter as ``PeftModel.from_pretrained`` loads it. Collective: every
    rank gathers the adapter's partitions (stage 3); ``is_main`` writes."""
    from zcore.zero import GatheredParameters

    adapter = [p for p in model.parameters() if p.requires_grad]
    partitioned = any(hasattr(p, "z_shape") for p in adapter)
    gather = GatheredParameters(adapter) if partitioned else contextlib.nullcontext()
    with gather:
        if is_main:  # peft keeps the adapter's tensors of the model's state_dict
            model.save_pretrained(output_dir, save_embedding_layers=False)  # type: ignore[operator]
    if dist.is_initialized():
        dist.barrier()
