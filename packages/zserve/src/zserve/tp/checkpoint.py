"""A checkpoint reader that gives one tensor-parallel rank its slice of each cut tensor.

:class:`ShardedCheckpoint` wraps a whole-model reader (:mod:`zserve.model.checkpoint`) and
answers ``get(name, shape)`` for the rank's local config (:class:`~zserve.tp.plan.RankShard`):
a cut tensor is read whole, checked against the whole model's shape, and sliced; every other
tensor passes through. A zquant directory's quantized layers are cut by
:mod:`zserve.tp.quantized` (:meth:`ShardedCheckpoint.cut_quantized`). The row-parallel biases (o, down) are added once: rank 0 keeps them,
the other ranks get zeros, so the all-reduce sums them once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zserve.model.checkpoint import Checkpoint, WeightsMismatchError
from zserve.model.config import LlamaConfig
from zserve.tp.plan import RankShard, TPPlanError, cut_range

if TYPE_CHECKING:
    from zserve.model.llama import LlamaModel
    from zserve.model.quantized import QuantizedLinears

_CUT = re.compile(
    r"model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.(weight|bias)"
)


class ShardedCheckpoint:
    """``inner``'s tensors as rank ``shard.rank`` holds them (``name in``, ``get``, ``model_dir``)."""

    def __init__(self, inner: Checkpoint, shard: RankShard, full: LlamaConfig) -> None:
        self.inner = inner
        self.shard = shard
        self.full = full
        self.model_dir: Path = inner.model_dir
        self.experts = shard.experts
        """Mixtral: the experts this rank holds (read by :meth:`SparseMoE.load`)."""

    def __contains__(self, name: str) -> bool:
        return name in self.inner

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The rank's slice of ``name``, checked to have ``shape`` (the local config's)."""
        m = _CUT.fullmatch(name)
        if m is None:
            return self.inner.get(name, shape)
        _, proj, kind = m.groups()
        s, h = self.shard, self.full.hidden_size
        axis, width, (a, b) = cut_range(proj, s, self.full)
        if axis == "rows":  # column-parallel: cut the output rows (and the bias)
            whole = self.inner.get(name, (width, h) if kind == "weight" else (width,))
            part = whole[a:b]
        elif kind == "bias":  # row-parallel: the bias is added on rank 0 only
            whole = self.inner.get(name, (h,))
            part = whole if s.rank == 0 else torch.zeros_like(whole)
        else:  # row-parallel: cut the input columns
            part = self.inner.get(name, (h, width))[:, a:b]
        if tuple(part.shape) != tuple(shape):
            raise WeightsMismatchError(
                f"tensor-parallel rank {s.rank}: slice of `{name}` is {list(part.shape)}, the "
                f"rank's model expects {list(shape)}"
            )
        return part.contiguous()

    def cut_quantized(self, whole: QuantizedLinears) -> QuantizedLinears:
        """A zquant directory's quantized layers as this rank holds them
        (:mod:`zserve.tp.quantized`)."""
        from zserve.tp.quantized import ShardedQuantizedLinears

        return ShardedQuantizedLinears.cut(whole, self.shard, self.full)


def cut_lm_head(model: LlamaModel, shard: RankShard) -> None:
    """Keep only the rank's vocab rows of ``model``'s LM head: a view of the loaded matrix,
    so a tied head stays rows of the embedding table, which the lookup keeps whole."""
    head = model.lm_head
    a, b = shard.vocab
    if not isinstance(head, torch.Tensor):  # a quantized head: its rows were cut at load
        rows = getattr(head, "out_features", None)
        if rows != b - a:
            raise TPPlanError(
                f"tensor-parallel rank {shard.rank}: the quantized LM head has {rows} rows, "
                f"its vocab slice {a}:{b} needs {b - a}; serve the directory with --tp 1"
            )
        return
    model.lm_head = head[a:b]
