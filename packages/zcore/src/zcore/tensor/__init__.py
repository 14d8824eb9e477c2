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
- :mod:`~zcore.tensor.state`: :func:`gather_full_state_dict` (``zcore.checkpoint.consolidate``
  reassembles the shards of a checkpoint from its manifest's ``tp_cuts`` too);
- :mod:`~zcore.tensor.config`: the ``tensor_parallel`` config block (``autotp_size``: the
  mesh's ``tp``; ``zcore.initialize`` then cuts a model not cut yet);
- :mod:`~zcore.tensor.dtensor_ref`: the same GPT cut by torch's ``parallelize_module``, the
  reference tests and ``z bench tp`` compare with.

Sequence parallelism (``parallelize(..., sequence_parallel=True)``, the ``gpt`` plan) keeps
norms, dropout and residuals on ``T/tp`` positions. Use::

    spec = MeshSpec.resolve(world, tp=2)
    engine, *_ = zcore.initialize(zcore.tensor.parallelize(model, spec), config=cfg, mesh=spec)
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
