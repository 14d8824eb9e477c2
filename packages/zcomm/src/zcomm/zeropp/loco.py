"""LoCo: error feedback for qgZ's INT4 gradient all-to-alls (``zeropp_loco_param``).

Quantizing a gradient to INT4 loses ``x - Q(x)``; LoCo keeps that loss and adds it to the
same bucket's next reduction, so over steps the sum of what was sent tracks the sum of the
true gradients. Each qgZ stage (intra-node, inter-node) of each gradient bucket has its own
error ``e`` (the ``k``-th bucket reduced in a step is bucket ``k`` in every step: backward
runs the same buckets in the same order). Per reduction, as DeepSpeed's LoCo kernels::

    c = x + e                               what is quantized and sent
    e <- beta e + (1 - beta) (c - Q(c))     beta = err_beta

and after ``reset_T`` reductions of a bucket its errors restart from zero (DeepSpeed counts
one global index across all tensors; here each bucket counts its own). Like DeepSpeed,
the errors are stored as INT8 blocks (a quarter of fp32's memory: every rank keeps an
error for every element it sends, i.e. the whole model's gradients); they are part of
:meth:`state_dict`, so a checkpoint restores them.
"""

from __future__ import annotations

from typing import Any

import torch

from zcomm.kernels import dequantize_blocks, quantize_blocks
from zcomm.zeropp.config import LocoConfig

ERROR_BITS = 8


class LocoErrors:
    """The error buffers of every bucket and stage (see the module docstring)."""

    def __init__(self, config: LocoConfig, block: int) -> None:
        self.config = config
        self.block = block
        self._buckets: dict[str, dict[str, Any]] = {}

    def begin(self, key: str) -> None:
        """A reduction of bucket ``key`` starts: count it; restart its errors every reset_T."""
        entry = self._buckets.setdefault(key, {"uses": 0})
        if entry["uses"] >= self.config.reset_T:
            self._buckets[key] = entry = {"uses": 0}
        entry["uses"] += 1

    def error(self, key: str, stage: str, numel: int, device: torch.device) -> torch.Tensor:
        """Bucket ``key``'s error for ``stage`` (float32, ``numel``; zeros when it has none
        yet or its size changed)."""
        saved = self._buckets.get(key, {}).get(stage)
        if saved is None or saved["numel"] != numel:
            return torch.zeros(numel, dtype=torch.float32, device=device)
        codes, scales = saved["codes"].to(device), saved["scales"].to(device)
        return dequantize_blocks(codes, scales, ERROR_BITS, self.block, numel)

    def keep(
        self, key: str, stage: str, error: torch.Tensor, sent: torch.Tensor, meant: torch.Tensor
    ) -> None:
        """Update bucket ``key``'s ``stage`` error after sending ``sent`` = Q(``meant``),
        ``meant`` being the compensated values ``x + error``."""
        beta = self.config.err_beta
        new = beta * error + (1.0 - beta) * (meant - sent)
        codes, scales = quantize_blocks(new, ERROR_BITS, self.block)
        entry = self._buckets.setdefault(key, {"uses": 0})
        entry[stage] = {"codes": codes, "scales": scales, "numel": new.numel()}

    def state_dict(self) -> dict[str, Any]:
        """Every bucket's use count and stored errors (tensors, ints)."""
        return {
            k: {s: (dict(v) if isinstance(v, dict) else v) for s, v in entry.items()}
            for k, entry in self._buckets.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._buckets = {
            k: {s: (dict(v) if isinstance(v, dict) else int(v)) for s, v in entry.items()}
            for k, entry in state.items()
        }
