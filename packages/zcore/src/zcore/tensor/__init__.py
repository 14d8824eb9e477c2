"""Tensor parallelism: layers cut over the mesh's ``tp`` axis, holding plain-tensor shards.

- :mod:`~zcore.tensor.regions`: the autograd functions at a region's edges (``copy_to``,
  ``reduce_from``, ``gather_from``, ``scatter_to``), every collective through the mesh's
  bounded, step-labelled ``tp`` :class:`~zcore.comm.Comm`;
- :mod:`~zcore.tensor.layers`: :class:`ColumnParallelLinear` (fused projections cut by
  blocks) and :class:`RowParallelLinear`;
- :mod:`~zcore.tensor.vocab`: :class:`VocabParallelEmbedding` and
  :func:`vocab_parallel_cross_entropy`;
- :mod:`~zcore.tensor.cut`: how a shard makes the full tensor (:class:`TPCut`); cut
  parameters are tagged ``zero_axis = "tp"`` so ZeRO partitions them over ``dp`` unchanged
  and sums their gradient norm over ``tp`` (:mod:`zcore.zero.axes`);
- :mod:`~zcore.tensor.parallelize`: :func:`parallelize` with the ``gpt`` and ``llama``
  plans (:mod:`~zcore.tensor.plan`);
- :mod:`~zcore.tensor.state`: :func:`gather_full_state_dict`.
- :mod:`~zcore.tensor.config`: the ``tensor_parallel`` config block (``autotp_size``).
"""

from __future__ import annotations

from zcore.tensor.cut import TPCut, cut_by_tp
from zcore.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorParallel
from zcore.tensor.parallelize import parallelize, plan_for, register_plan, registered_plans
from zcore.tensor.plan import Plan
from zcore.tensor.regions import copy_to, gather_from, reduce_from, scatter_to
from zcore.tensor.state import gather_full_state_dict
from zcore.tensor.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "Plan",
    "RowParallelLinear",
    "TPCut",
    "TensorParallel",
    "VocabParallelEmbedding",
    "copy_to",
    "cut_by_tp",
    "gather_from",
    "gather_full_state_dict",
    "parallelize",
    "plan_for",
    "reduce_from",
    "register_plan",
    "registered_plans",
    "scatter_to",
    "vocab_parallel_cross_entropy",
]
