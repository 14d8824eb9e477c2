"""Serving with decoder-layer weights beyond a memory budget (ZeRO-Inference).

    pipe = zserve.pipeline(model_dir, weights_budget="64M", offload="nvme",
                           offload_dir="/nvme/swap")

The layers that fit ``weights_budget`` stay resident; the rest live in host memory
(``cpu``) or in a swap file read with O_DIRECT through znative's async IO engine
(``nvme``), each fetched one or more layers ahead into a ring of slots and overwritten
after use (:mod:`zserve.offload.stream`). A `z quantize` directory streams its quantized
bytes. The model calls :meth:`LayerStream.acquire` / :meth:`LayerStream.release` around
each layer.
"""

from zserve.offload.load import load_layers
from zserve.offload.plan import OffloadSpec, Plan, WeightsBudgetError, parse_size, plan_layers
from zserve.offload.store import OffloadDirError
from zserve.offload.stream import LayerStream

__all__ = [
    "LayerStream",
    "OffloadDirError",
    "OffloadSpec",
    "Plan",
    "WeightsBudgetError",
    "load_layers",
    "parse_size",
    "plan_layers",
]
