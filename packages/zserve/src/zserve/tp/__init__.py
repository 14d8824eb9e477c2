"""Tensor-parallel serving: a LLaMA-family model cut over ``tp`` ranks (``zserve.pipeline(...,
tp=N)``, ``z serve MODEL --tp N``).

* :mod:`zserve.tp.plan` — which heads, MLP columns and vocab rows each rank holds, chosen
  from the config (uneven head counts included);
* :mod:`zserve.tp.checkpoint` — a rank's slice of each checkpoint tensor;
* :mod:`zserve.tp.quantized` — a rank's cut of a `z quantize` directory's packed layers
  (W8A8, W4, FP6);
* :mod:`zserve.tp.group` — the gloo process groups (torch's ``init_device_mesh``), bounded
  collectives and :class:`~zserve.tp.group.TPRankError`;
* :mod:`zserve.tp.p2p` — the layers' all-reduces and gathers, and each step's batch, as
  torch.distributed point-to-point sends and receives (the group's default);
* :mod:`zserve.tp.wire` — a step's batch as one tensor, posted by rank 0;
* :mod:`zserve.tp.runner` — rank 0's :class:`~zserve.tp.runner.TPRunner` (the engine's
  runner) and the workers' loop.

Nothing is imported here, so ``zserve.runner`` can use the plan and the checkpoint slicing
without loading torch.distributed.
"""
