"""Build a model already partitioned, and look at partitioned parameters whole."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zcore.comm import Comm, job_mesh, mesh_for_config
from zcore.zero.axes import cut_of, group_axes, set_cut
from zcore.zero.stage3 import Stage3Params

_ACTIVE: list[Init] = []
"""The ``Init`` blocks entered and not yet left, innermost last."""


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out.add(sub)
        out |= _all_subclasses(sub)
    return out


class Init:
    """Construct modules inside this block and each one is partitioned as soon as its own
    ``__init__`` returns, so the full model never exists on one rank (ZeRO stage 3).

    Every rank must run the same construction code; each parameter is broadcast from rank 0
    before it is cut, so all ranks agree even if their random states differ. Initialisation
    done after construction through ``model.apply(fn)`` sees full parameters (each module's
    own are gathered around ``fn``, then broadcast from rank 0 and re-cut); anything else
    that edits parameters later must use :class:`GatheredParameters`. A parameter created on
    the meta device has no value yet and is left whole: a loader partitions it once it has
    read it (:func:`zcore.hf.from_pretrained`, which also finds the open block through
    :meth:`active`).

    Args:
        persistence_threshold: parameters with at most this many elements stay whole.
        timeout_s: bound on each collective (see ``comm_timeout_s``).
        enabled: ``False`` makes the block a no-op (handy for stage 0-2 configs).
    """

    def __init__(
        self,
        persistence_threshold: int = 100_000,
        timeout_s: float = 1800.0,
        enabled: bool = True,
        config: Any = None,
    ) -> None:
        self.enabled = enabled
        self.config: Any = None
        if config is not None:
            from zcore.config import ZConfig

            cfg = self.config = ZConfig.load(config)
            zc = cfg.zero_optimization
            self.enabled = enabled and zc.stage == 3
            persistence_threshold = int(zc.stage3_param_persistence_threshold)
            timeout_s = cfg.comm_timeout_s
        self.persistence_threshold = persistence_threshold
        self.timeout_s = timeout_s
        self.stage3: Stage3Params | None = None
        self._patched: list[tuple[type, Any]] = []
        self._apply: Any = None

    def __enter__(self) -> Init:
        if not self.enabled:
            _ACTIVE.append(self)
            return self
        if self.config is not None:
            mesh = mesh_for_config(self.config)
        else:
            mesh = job_mesh(None, self.timeout_s)
        self._mesh = mesh
        self.data_axis = group_axes(mesh)["dp"]
        self.stage3 = Stage3Params(
            mesh.comm("dp"), persistence_threshold=self.persistence_threshold
        )
        off = self.config.zero_optimization.offload_param if self.config is not None else None
        if off is not None and off.device != "none":
            # offloaded shards leave memory as each module is built
            from zcore.zero.backends import param_backend

            self.stage3.store = param_backend(off.device)(self.config, self.stage3)
        for cls in _all_subclasses(nn.Module) | {nn.Module}:
            if "__init__" in cls.__dict__:
                self._patched.append((cls, cls.__dict__["__init__"]))
                cls.__init__ = self._wrap_init(cls.__dict__["__init__"])  # type: ignore[misc]
        self._apply = nn.Module.apply
        nn.Module.apply = self._wrap_apply(self._apply)  # type: ignore[method-assign]
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if not self.enabled:
            return
        for cls, init in self._patched:
            cls.__init__ = init  # type: ignore[misc]
        self._patched.clear()
        nn.Module.apply = self._apply  # type: ignore[method-assign]

    @staticmethod
    def active() -> Init | None:
        """The innermost block now open on this process, enabled or not (None outside any)."""
        return _ACTIVE[-1] if _ACTIVE else None

    def _from_rank0(self, p: nn.Parameter, what: str) -> None:
        """``p`` as rank 0 has it, on every rank holding the same values (the mesh's first
        data-parallel rank; its mirrors too)."""
        self.data_axis.broadcast_from_first(p.data, what)

    def _wrap_init(self, init: Any) -> Any:
        stage3 = self.stage3
        assert stage3 is not None

        @functools.wraps(init)
        def wrapped(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            depth = module.__dict__.get("_z_init_depth", 0)
            object.__setattr__(module, "_z_init_depth", depth + 1)
            try:
                init(module, *args, **kwargs)
            finally:
                object.__setattr__(module, "_z_init_depth", depth)
            if depth == 0:
                del module.__dict__["_z_init_depth"]
                object.__setattr__(module, "_z_stage3", stage3)
                for name, p in module.named_parameters(recurse=False):
                    if p not in stage3.params and not p.is_meta:
                        self._from_rank0(p, "broadcast(zero.Init parameter)")
                        stage3.partition(p, name)
                        set_cut(p, self.data_axis)

        return wrapped

    def _wrap_apply(self, apply: Any) -> Any:
        """``nn.Module.apply`` that runs ``fn`` on each module with its own parameters whole.

        The original ``apply`` recurses through ``child.apply``, which is this replacement
        again: a ``fn`` already wrapped is passed on unchanged, so each module is gathered,
        edited, broadcast from rank 0, re-cut and released exactly once.
        """
        stage3 = self.stage3
        assert stage3 is not None

        def gathered_fn(fn: Any, m: nn.Module) -> None:
            own = [p for p in m.parameters(recurse=False) if p in stage3.params]
            stage3.gather(own, "gather(zero.Init apply)")
            try:
                fn(m)
                for p in own:  # ranks may draw different random values: rank 0's win
                    self._from_rank0(p, "broadcast(zero.Init apply)")
                    stage3.repartition(p)
            finally:
                stage3.release(own)

        def wrapped(module: nn.Module, fn: Any) -> nn.Module:
            if not (isinstance(fn, functools.partial) and fn.func is gathered_fn):
                fn = functools.partial(gathered_fn, fn)
            return apply(module, fn)

        return wrapped


class GatheredParameters:
    """Full values of (possibly partitioned) parameters inside the block.

    With ``modifier_rank=r``, edits made on data-parallel rank ``r`` inside the block are
    broadcast over the parameter's data axes (``dp_replicate x dp``; experts: the ranks
    holding the same experts) and re-partitioned on exit (fp32 master weights of an engine included);
    with ``modifier_rank=None`` the block is read-only and edits are discarded.
    Collective: every rank must enter it with the same parameters.
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        enabled: bool = True,
    ) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.stage3: Stage3Params | None = None
        for p in self.params:
            owner = getattr(p, "_z_owner", None)
            if owner is not None:
                self.stage3 = owner
        self._comm: Comm | None = None

    def __enter__(self) -> list[nn.Parameter]:
        if not self.enabled:
            return self.params
        s3 = self.stage3
        if s3 is not None:
            s3.gather(self.params, "gather(GatheredParameters)")
        return self.params

    def __exit__(self, *exc: object) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if not self.enabled:
            return
        s3 = self.stage3
        try:
            if self.modifier_rank is not None:
                # data rank `modifier_rank` of each parameter's data axes: every replica of
                # the partition takes it; parameters no engine or zero.Init placed: the job's
                world = None
                for p in self.params:
                    what = "broadcast(GatheredParameters)"
                    axis = cut_of(p)
                    if axis is not None:
                        axis.broadcast_from(p.data, self.modifier_rank, what)
                    else:
                        world = world or _world_comm(s3.comm.timeout_s if s3 else 1800.0)
                        world.broadcast(p.data, self.modifier_rank, what).wait()
                    if s3 is not None and p in s3.params:
                        s3.repartition(p)
                    else:
                        for fn in getattr(p, "_z_on_edit", []):
                            fn(p)
        finally:  # a failed exit must not leave parameters gathered
            if s3 is not None:
                s3.release(self.params)


def _world_comm(timeout_s: float) -> Comm:
    """Collectives over every rank of the job (no-ops on a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Comm(None, 0, 1, timeout_s)
    return Comm(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), timeout_s)
