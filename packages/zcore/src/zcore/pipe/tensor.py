"""Tensor parallelism inside pipeline stages: the ``pipe`` plan of ``zcore.tensor.parallelize``.

A :class:`~zcore.pipe.PipelineModule` is cut layer by layer. A layer class that can be cut
says how with two methods:

- ``tp_problems(tp) -> list[str]``: every reason it cannot be cut over ``tp`` ranks (checked
  for every layer of the model, built on ``meta``, before anything changes, so each rank
  raises the same error naming every number);
- ``tp_cut(comm) -> nn.Module | None``: cut itself over the ``tp`` comm, in place (``None``)
  or by returning its replacement (an embedding becoming a
  :class:`~zcore.tensor.VocabParallelEmbedding`).

Only the layers this rank builds (its stages' layers and tied modules) are cut; a layer
without ``tp_cut`` stays whole on every ``tp`` rank (a mirror: LayerNorms, position
embeddings). Stage boundaries carry whole activations, the same on every ``tp`` rank (no
sequence parallelism across stages, DeepSpeed's ``pipe_partitioned`` is refused), so each
``tp`` coordinate runs its own copy of the schedule over its own ``pp`` group. A tied module
cut over ``tp`` (a vocabulary-parallel embedding read by the output head) is the same
vocabulary slice on every stage holding it, so the tie sums its gradient over ``pp`` shard
by shard.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zcore.comm import Comm
from zcore.pipe.module import PipelineModule
from zcore.pipe.spec import LayerSpec
from zcore.tensor.layers import TensorParallel
from zcore.tensor.parallelize import register_plan
from zcore.tensor.plan import Plan


def _matches(model: nn.Module) -> bool:
    return isinstance(model, PipelineModule)


def _meta_layer(spec: Any) -> Any:
    return spec.build_meta() if isinstance(spec, LayerSpec) else spec


def _problems(model: nn.Module, tp: int) -> list[str]:
    assert isinstance(model, PipelineModule)
    problems: list[str] = []
    seen: set[str] = set()
    for idx, spec in enumerate(model.specs):
        layer = _meta_layer(spec)
        check = getattr(layer, "tp_problems", None)
        if not callable(check):
            continue
        name = f"layer {idx} ({type(layer).__name__})"
        for problem in check(tp):
            if problem not in seen:  # one line per distinct problem, not per block
                seen.add(problem)
                problems.append(f"{name}: {problem}")
    if not any(callable(getattr(_meta_layer(s), "tp_cut", None)) for s in model.specs):
        problems.append(
            "no layer of the PipelineModule can be cut (none has a `tp_cut(comm)` method); "
            "give its layer classes `tp_cut`, or run it without tensor parallelism"
        )
    return problems


def _cut(module: nn.Module, comm: Comm) -> nn.Module | None:
    if isinstance(module, TensorParallel):
        return None
    cut = getattr(module, "tp_cut", None)
    if not callable(cut):
        return None
    new = cut(comm)
    return new if new is not None and new is not module else None


def _apply(model: nn.Module, comm: Comm, sequence_parallel: bool) -> None:
    assert isinstance(model, PipelineModule)
    if sequence_parallel:
        raise ValueError(
            "sequence parallelism inside pipeline stages is not built: stages send whole "
            "(B, T, C) activations to each other; parallelize the PipelineModule without "
            "sequence_parallel"
        )
    replaced: dict[int, nn.Module] = {}
    for table in (model.tied, model.layers):
        for key, module in list(table.items()):
            new = _cut(module, comm)
            if new is not None:
                table[key] = new
                replaced[id(module)] = new
    for stage in model.stages:
        stage.replace(replaced)


PLAN = Plan("pipe", _matches, _problems, _apply)
register_plan(PLAN)
