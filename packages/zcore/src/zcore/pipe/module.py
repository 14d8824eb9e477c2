"""``PipelineModule``: a model given as a list of layers, cut into pipeline stages.

DeepSpeed's user API::

    model = PipelineModule(
        layers=[LayerSpec(Embed, vocab, dim), *[LayerSpec(Block, dim) for _ in range(n)],
                LayerSpec(Head, dim, vocab)],
        num_stages=2, loss_fn=cross_entropy, partition_method="parameters",
    )

Each rank builds only the layers of its own stage(s) (a rank at pipeline coordinate ``r``
holds stage ``r``; with ``virtual_stages=v`` the model is cut into ``num_stages*v`` stages
and the rank holds ``r, r+num_stages, ...`` (``stage_order="loop"``, interleaved 1F1B) or
``r`` and ``2*num_stages-1-r`` (``stage_order="v"``, ZB-V)). Layers of other stages are
built on the ``meta`` device only, to count parameters and to infer the activation shape
between stages (:meth:`PipelineModule.stage_shapes`), so no probe forward runs.

Parameter names are per layer index (``layers.<i>.…``) and tie key (``tied.<key>.…``), the
same on every layout, so checkpoints can be keyed by them.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zcore.pipe.partition import partition
from zcore.pipe.spec import LayerSpec, TiedLayerSpec
from zcore.zero.init import Init

Layer = LayerSpec | nn.Module | Callable[[Any], Any]


def _place() -> tuple[int, int]:
    """This process's (rank, world): the process group's, else the launcher's variables."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def stage_ids(coord: int, num_stages: int, virtual: int, order: str) -> list[int]:
    """The stages a rank at pipeline coordinate ``coord`` holds (see the module docstring)."""
    if order == "v":
        return [coord, 2 * num_stages - 1 - coord]
    return [coord + k * num_stages for k in range(virtual)]


class _Tied(nn.Module):
    """One use of a tied module: ``forward_fn(module, x)`` or ``module(x)``. The module is
    a child, so the stage's ``parameters()`` (which zero-bubble schedules differentiate
    for the weight gradients) include it."""

    def __init__(self, module: nn.Module, spec: TiedLayerSpec) -> None:
        super().__init__()
        self.module = module
        self.spec = spec

    def forward(self, x: Any) -> Any:
        return self.spec.forward_fn(self.module, x) if self.spec.forward_fn else self.module(x)


class Stage(nn.Module):
    """The layers of one pipeline stage, run in order (``torch.distributed.pipelining``
    wraps it in a ``PipelineStage``). Every ``interval`` layers form one activation
    checkpoint when ``interval > 0``."""

    def __init__(self, index: int, layers: Sequence[Any], interval: int) -> None:
        super().__init__()
        self.index = index
        self.run = nn.ModuleList(m for m in layers if isinstance(m, nn.Module))
        self._calls = list(layers)
        self.interval = interval

    def _chunk(self, calls: Sequence[Any], x: Any) -> Any:
        for f in calls:
            x = f(x)
        return x

    def replace(self, new: dict[int, nn.Module]) -> None:
        """Swap layers (and tied modules) for their replacements, keyed by the old module's
        ``id`` (a tensor-parallel plan replacing a layer by its cut)."""
        for f in self._calls:
            if isinstance(f, _Tied) and id(f.module) in new:
                f.module = new[id(f.module)]
        self._calls = [new.get(id(f), f) for f in self._calls]
        self.run = nn.ModuleList(m for m in self._calls if isinstance(m, nn.Module))

    def forward(self, x: Any) -> Any:
        if self.interval <= 0 or not torch.is_grad_enabled():
            return self._chunk(self._calls, x)
        for i in range(0, len(self._calls), self.interval):
            x = checkpoint(self._chunk, self._calls[i : i + self.interval], x, use_reentrant=False)
        return x


class PipelineModule(nn.Module):
    """A sequence of layers cut into ``num_stages`` pipeline stages (module docstring)."""

    def __init__(
        self,
        layers: Sequence[Layer],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        virtual_stages: int = 1,
        stage_order: Literal["loop", "v"] = "loop",
    ) -> None:
        super().__init__()
        if topology is not None:
            raise ValueError(
                "PipelineModule(topology=...) is not supported: the job's mesh places the "
                "stages; give num_stages (and zcore.initialize(..., mesh=MeshSpec...))"
            )
        if num_stages is None or num_stages < 1:
            raise ValueError(f"PipelineModule needs num_stages >= 1, got {num_stages}")
        block = Init.active()
        if num_stages > 1 and block is not None and block.enabled:
            raise ValueError(
                f"PipelineModule(num_stages={num_stages}) inside zcore.zero.Init is not "
                "supported: zero.Init cuts each parameter over every data-parallel rank of "
                "the job as it is built, but each pipeline rank builds different layers; "
                "build the PipelineModule outside zero.Init (each rank already builds only "
                "its own stages' layers, and zcore.initialize at ZeRO stage 3 cuts them over dp)"
            )
        if virtual_stages < 1 or (stage_order == "v" and virtual_stages != 2):
            raise ValueError(
                f"virtual_stages {virtual_stages} with stage_order {stage_order!r}: use "
                "virtual_stages >= 1, and exactly 2 with stage_order='v'"
            )
        if stage_order not in ("loop", "v"):
            raise ValueError(f"stage_order {stage_order!r} is not 'loop' or 'v'")
        self.specs = list(layers)
        self.num_stages = num_stages
        self.virtual_stages = virtual_stages
        self.stage_order = stage_order
        self.total_stages = num_stages * virtual_stages
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.seed_layers, self.base_seed = seed_layers, base_seed

        rank, world = _place()
        if world % num_stages:
            raise ValueError(
                f"world size {world} is not divisible by num_stages {num_stages}; launch "
                f"a multiple of {num_stages} ranks (pp {num_stages} x dp x tp)"
            )
        self.stage_coord = rank // (world // num_stages)
        self.local_stages = stage_ids(self.stage_coord, num_stages, virtual_stages, stage_order)
        names = [self._type_name(s) for s in self.specs]
        counts = [self._param_count(s) for s in self.specs]
        v_shape = stage_order == "v"
        self.parts = partition(partition_method, names, counts, self.total_stages, v_shape)

        self.layers = nn.ModuleDict()
        self.tied = nn.ModuleDict()
        self.tie_stages: dict[str, list[int]] = {}
        for idx, spec in enumerate(self.specs):
            if isinstance(spec, TiedLayerSpec):
                self.tie_stages.setdefault(spec.key, []).append(self.stage_of(idx))
        self.stages: list[Stage] = []  # plain list: the layers are registered above
        for sid in self.local_stages:
            calls = [self._build(i) for i in range(self.parts[sid], self.parts[sid + 1])]
            self.stages.append(Stage(sid, calls, activation_checkpoint_interval))

    # -- building -------------------------------------------------------------------------
    @staticmethod
    def _type_name(spec: Layer) -> str:
        return spec.typename.__name__ if isinstance(spec, LayerSpec) else type(spec).__name__

    @staticmethod
    def _param_count(spec: Layer) -> int:
        module = spec.build_meta() if isinstance(spec, LayerSpec) else spec
        if not isinstance(module, nn.Module):
            return 0
        return sum(p.numel() for p in module.parameters() if p.requires_grad)

    def stage_of(self, idx: int) -> int:
        """The stage holding layer ``idx``."""
        return next(s for s in range(self.total_stages) if idx < self.parts[s + 1])

    def _build(self, idx: int) -> Any:
        spec = self.specs[idx]
        if self.seed_layers:
            torch.manual_seed(self.base_seed + idx)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied:
                self.tied[spec.key] = spec.build()
            return _Tied(self.tied[spec.key], spec)
        module = spec.build() if isinstance(spec, LayerSpec) else spec
        if isinstance(module, nn.Module):
            self.layers[str(idx)] = module
        return module

    # -- running --------------------------------------------------------------------------
    def forward(self, x: Any) -> Any:
        """This rank's stages in order (the whole model when it holds every stage)."""
        for stage in self.stages:
            x = stage(x)
        return x

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        """The parameters a tie shares (its spec's ``tied_weight_attr``), on this rank."""
        spec = next(s for s in self.specs if isinstance(s, TiedLayerSpec) and s.key == key)
        return [getattr(self.tied[key], a) for a in spec.tied_weight_attr]

    def stage_shapes(self, example: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """The activation entering each stage and leaving the last one (meta tensors; the
        floating ones require gradients) for
        micro-batch input ``example``: stage ``s`` takes ``out[s]`` and gives ``out[s+1]``.
        Layers run on the ``meta`` device in ``dtype`` (no memory, no communication)."""
        tied: dict[str, nn.Module] = {}
        x: Any = torch.empty_like(example, device="meta")
        out = [x]
        with torch.no_grad():
            for s in range(self.total_stages):
                for idx in range(self.parts[s], self.parts[s + 1]):
                    x = self._meta_call(idx, x, dtype, tied)
                out.append(x)
        # activations between stages carry gradients back (the stage infers its sends from it)
        return [t.detach().requires_grad_(t.is_floating_point()) for t in out]

    def _meta_call(self, idx: int, x: Any, dtype: torch.dtype, tied: dict[str, nn.Module]) -> Any:
        spec = self.specs[idx]
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build_meta().to(dtype)
            module = tied[spec.key]
            return spec.forward_fn(module, x) if spec.forward_fn else module(x)
        if isinstance(spec, LayerSpec):
            return spec.build_meta().to(dtype)(x)
        if isinstance(spec, nn.Module):
            return copy.deepcopy(spec).to(device="meta", dtype=dtype)(x)
        return spec(x)
