"""Pipeline parallelism with DeepSpeed's user API on ``torch.distributed.pipelining``.

``PipelineModule(layers=[LayerSpec | TiedLayerSpec | nn.Module, ...], num_stages, ...)``
describes the model (:mod:`zcore.pipe.module`); ``zcore.initialize(model=..., config=...)``
returns a :class:`~zcore.pipe.engine.PipelineEngine` whose ``train_batch(data_iter)`` runs
the ``pipeline.schedule`` (GPipe, 1F1B, interleaved 1F1B, ZB-V) over
``gradient_accumulation_steps`` micro-batches and steps once, with ZeRO 0-3 over ``dp``
(stage 3: each stage's parameters gathered once per step, :mod:`zcore.pipe.stage3`).
Layers with a ``tp_cut(comm)`` method are cut over ``tp`` by ``zcore.tensor.parallelize``
(or ``tensor_parallel.autotp_size``): the ``pipe`` plan of :mod:`zcore.pipe.tensor`.
"""

from __future__ import annotations

from zcore.pipe.module import PipelineModule
from zcore.pipe.spec import LayerSpec, TiedLayerSpec
from zcore.pipe.tensor import PLAN as TENSOR_PLAN  # importing it registers the plan

__all__ = ["TENSOR_PLAN", "LayerSpec", "PipelineModule", "TiedLayerSpec"]
