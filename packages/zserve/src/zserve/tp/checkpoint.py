"""A checkpoint reader that gives one tensor-parallel rank its slice of each cut tensor.

:class:`ShardedCheckpoint` wraps a whole-model reader (:mod:`zserve.model.checkpoint`) and
answers ``get(name, shape)`` for the rank's local config (:class:`~zserve.tp.plan.RankShard`):
a cut tensor is read whole, checked against the whole model's shape, and sliced; every other
tensor passes through. The row-parallel biases (o, down) are added once: rank 0 keeps them,
the other ranks get zeros, so the all-reduce sums them once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zserve.model.checkpoint import Checkpoint, WeightsMismatchError
from zserve.model.config import LlamaConfig
from zserve.tp.plan import RankShard, TPPlanError

if TYPE_CHECKING:
    from zserve.model.llama import LlamaModel

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
        s, c, d = self.shard, self.full, self.full.head_dim
        h = c.hidden_size
        rows = {
            "q": (c.q_size, (s.q_heads[0] * d, s.q_heads[1] * d)),
            "k": (c.kv_size, (s.kv_heads[0] * d, s.kv_heads[1] * d)),
            "v": (c.kv_size, (s.kv_heads[0] * d, s.kv_heads[1] * d)),
            "gate": (c.intermediate_size, s.mlp),
            "up": (c.intermediate_size, s.mlp),
        }
        if proj in rows:  # column-parallel: cut the output rows (and the bias)
            out, (a, b) = rows[proj]
            whole = self.inner.get(name, (out, h) if kind == "weight" else (out,))
            part = whole[a:b]
        else:  # row-parallel: cut the input columns; the bias is added on rank 0 only
            width, (a, b) = (
                (c.q_size, (s.q_heads[0] * d, s.q_heads[1] * d))
                if proj == "o"
                else (c.intermediate_size, s.mlp)
            )
            if kind == "bias":
                whole = self.inner.get(name, (h,))
                part = whole if s.rank == 0 else torch.zeros_like(whole)
            else:
                part = self.inner.get(name, (h, width))[:, a:b]
        if tuple(part.shape) != tuple(shape):
            raise WeightsMismatchError(
                f"tensor-parallel rank {s.rank}: slice of `{name}` is {list(part.shape)}, the "
                f"rank's model expects {list(shape)}"
            )
        return part.contiguous()


def cut_lm_head(model: LlamaModel, shard: RankShard) -> None:
    """Keep only the rank's vocab rows of ``model``'s LM head: a view of the loaded matrix,
    so a tied head stays rows of the embedding table, which the lookup keeps whole."""
    head = model.lm_head
    if not isinstance(head, torch.Tensor):
        raise TPPlanError(
            "tensor-parallel serving cuts the LM head by vocab rows; this one is a quantized "
            "module: serve the directory with --tp 1"
        )
    a, b = shard.vocab
    model.lm_head = head[a:b]
