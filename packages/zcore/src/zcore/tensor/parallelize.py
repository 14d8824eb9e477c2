"""``parallelize(model, mesh)``: cut a model's layers over the mesh's ``tp`` axis by a plan.

A :class:`Plan` knows one family of models: whether a model is one of them (from its
config, never from a checkpoint's name), every size that must divide by ``tp`` (all are
checked before anything changes, and one error names each number and the fix), and how to
swap its layers for tensor-parallel ones. The plans zcore ships are registered here:

- ``gpt``: ``z train``'s nanoGPT-style GPT (:mod:`zcore.tensor.gpt_plan`);
- ``llama``: Hugging Face ``LlamaForCausalLM`` and the models sharing its layout
  (``mistral``, ``qwen2``; :mod:`zcore.tensor.llama_plan`).

Layers swapped keep their names, so the state dict has the same keys, each holding this
rank's shard. The model is then handed to ``zcore.initialize`` with the same mesh::

    spec = MeshSpec.resolve(world, tp=2)
    model = zcore.tensor.parallelize(model, spec)
    engine, *_ = zcore.initialize(model, config=cfg, mesh=spec)
"""

from __future__ import annotations

import torch
from torch import nn

from zcore.comm import Mesh, MeshError, MeshSpec, job_mesh
from zcore.tensor import gpt_plan, llama_plan
from zcore.tensor.config import config_tp
from zcore.tensor.layers import TensorParallel
from zcore.tensor.plan import Plan

DEFAULT_TIMEOUT_S = 1800.0
"""The ``tp`` comm's timeout until the engine rebinds it to its config's ``comm_timeout_s``."""

_PLANS: dict[str, Plan] = {}


def register_plan(plan: Plan, *, replace: bool = False) -> None:
    """Make ``plan`` one that :func:`parallelize` may choose (or be asked for by name)."""
    if plan.name in _PLANS and _PLANS[plan.name] is not plan and not replace:
        raise ValueError(f"a tensor-parallel plan named {plan.name!r} is registered already")
    _PLANS[plan.name] = plan


def registered_plans() -> list[str]:
    return sorted(_PLANS)


def describe_model(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None) or type(cfg).__name__
    return f"{type(model).__name__} (config: {kind})"


def plan_for(model: nn.Module, plan: Plan | str | None = None) -> Plan:
    """The plan named or given, else the registered one whose ``matches`` takes ``model``."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str):
        if plan not in _PLANS:
            raise ValueError(
                f"no tensor-parallel plan named {plan!r}; the plans are {', '.join(sorted(_PLANS))}"
            )
        return _PLANS[plan]
    found = [p for p in _PLANS.values() if p.matches(model)]
    if not found:
        raise ValueError(
            f"no tensor-parallel plan for {describe_model(model)}; the plans are "
            f"{', '.join(sorted(_PLANS))} (GPT, Hugging Face LLaMA/Mistral/Qwen2); pass "
            "`plan=` a zcore.tensor.Plan for another model"
        )
    return found[0]


def parallelize(
    model: nn.Module,
    mesh: Mesh | MeshSpec,
    plan: Plan | str | None = None,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Cut ``model``'s layers over ``mesh``'s ``tp`` ranks (in place; ``model`` returned);
    ``sequence_parallel``: norms, dropout and residuals hold ``T/tp`` positions (the ``gpt``
    plan; the sequence length must then divide by ``tp``).

    Every rank must pass the same full model (the same initialization): each keeps its own
    shard. Raises ``ValueError`` naming every size that ``tp`` does not divide, before any
    layer changes.
    """
    if isinstance(mesh, MeshSpec):
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        mesh = job_mesh(mesh, DEFAULT_TIMEOUT_S, device)
    if any(hasattr(p, "_z_owner") for p in model.parameters()):
        raise ValueError(
            "the model's parameters are partitioned by zcore.zero.Init; build the model "
            "outside zero.Init for tensor parallelism (each rank keeps only its tp shard, and "
            "ZeRO stage 3 partitions the shards when the engine starts)"
        )
    chosen = plan_for(model, plan)
    tp = mesh.spec.tp
    problems = chosen.problems(model, tp)
    if problems:
        raise ValueError(
            f"cannot cut {describe_model(model)} over tp {tp} with the {chosen.name!r} plan:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    chosen.apply(model, mesh.comm("tp"), sequence_parallel)
    return model


for _plan in (gpt_plan.PLAN, llama_plan.PLAN):
    register_plan(_plan)


def parallelize_for_config(model: nn.Module, config: object, mesh: Mesh) -> None:
    """What ``zcore.initialize`` does for ``tensor_parallel.autotp_size``: cut ``model`` over
    ``mesh``'s ``tp`` unless it is cut already (nothing when the config asks for no ``tp``)."""
    want = config_tp(config)
    if want == 1:
        return
    if mesh.spec.tp != want:
        raise MeshError(
            f"tensor_parallel.autotp_size is {want} but the mesh has tp {mesh.spec.tp} "
            f"({mesh.spec.formula()}); pass no mesh= or build it with tp={want}"
        )
    if not any(isinstance(m, TensorParallel) for m in model.modules()):
        parallelize(model, mesh)
