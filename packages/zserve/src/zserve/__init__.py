"""zserve: high-throughput LLM serving.

A model runner for the LLaMA family and Mixtral over a blocked (paged) KV cache with
ragged batching, the Dynamic SplitFuse and prefill-first schedulers, prefix caching,
sampling, the non-persistent :func:`pipeline` API and an OpenAI-compatible HTTP server
with replicas (``z serve``), tensor-parallel over gloo ranks (``tp=N``, :mod:`zserve.tp`). It
loads Hugging Face-format checkpoints (config.json + safetensors).

``import zserve`` stays light: the names below load their modules (and torch) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from zserve.config import EngineConfig
    from zserve.engine import Engine, make_engine
    from zserve.outputs import Completion, RequestOutput
    from zserve.pipelines import Pipeline, pipeline
    from zserve.runner import ModelRunner, SeqChunk
    from zserve.sampling import SamplingParams

_EXPORTS = {
    "EngineConfig": "zserve.config",
    "Engine": "zserve.engine",
    "make_engine": "zserve.engine",
    "Completion": "zserve.outputs",
    "RequestOutput": "zserve.outputs",
    # The module is `pipelines`, not `pipeline`: importing a submodule binds it as an
    # attribute of this package, which would shadow the lazily exported function.
    "Pipeline": "zserve.pipelines",
    "pipeline": "zserve.pipelines",
    "ModelRunner": "zserve.runner",
    "SeqChunk": "zserve.runner",
    "SamplingParams": "zserve.sampling",
}

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "ModelRunner",
    "Pipeline",
    "RequestOutput",
    "SamplingParams",
    "SeqChunk",
    "__version__",
    "make_engine",
    "pipeline",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
