"""How each parameter is cut across the mesh, and so what every reduction spans.

Each parameter says how it is cut; today that is its data-parallel slot axis. Dense
parameters are cut across ``dp`` (and summed across ``dp_replicate`` replicas, MiCS).
A parameter tagged ``p.zero_axis = "edp"`` — an expert's, set by the MoE layer that built
it — is cut across the expert-data-parallel ranks instead: the ranks that hold the same
experts. Ranks on different ``ep`` coordinates hold *different* expert parameters, so
nothing is reduced across ``ep``; only the gradient norm and the overflow flag are summed
over it. With ``ep = 1`` the expert axis is the dense one, but expert parameters still form
groups of their own, so a checkpoint has the same groups at every ``ep``.

Every other mesh axis is, for a group, one of two kinds (:class:`GroupAxis`): ``disjoint``
(ranks hold different parameters: pipeline stages, expert-parallel ranks), across which
the gradient norm and the overflow flag are summed so each element counts exactly once in
the job; or ``mirrors`` (ranks hold the same values and compute the same gradients: a
tensor-parallel axis for parameters it does not cut), which no reduction touches and on
which only coordinate 0 writes checkpoint files. A parameter cut by tensor parallelism
(``p.zero_axis = "tp"``, set by :mod:`zcore.tensor`'s layers: different elements on each
``tp`` rank) is cut across ``dp`` like a dense one, in groups of its own whose ``disjoint``
holds ``tp`` (its norm and overflow flag are summed across ``tp``) and which have no
mirrors (every ``tp`` coordinate writes its own rank files); dense parameters keep ``tp``
as a mirror.

The engine splits each optimizer param group by axis (as DeepSpeed splits MoE parameters
into groups of their own): dense parameters keep their group, tensor-parallel shards move to
a new group with the same hyperparameters and ``"axis": "tp"`` after every dense group, and
expert ones to one with ``"axis": "edp"`` after those.

Layers that need an axis of the mesh say so with two methods the engine calls:
``mesh_axes() -> {"ep": n}`` before the mesh is built, ``bind_mesh(mesh)`` after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zcore.comm import Comm, Mesh, MeshError

ATTR = "zero_axis"
"""The parameter attribute naming its axis (absent: ``"dp"``)."""
AXES = ("dp", "tp", "edp")
MODEL_AXES = ("ep",)
"""The mesh sizes a layer may ask for through ``mesh_axes()``."""


def param_axis(p: nn.Parameter) -> str:
    """The axis ``p`` is sharded over (``"dp"`` unless tagged)."""
    axis = getattr(p, ATTR, "dp")
    if axis not in AXES:
        raise ValueError(
            f"a parameter of shape {list(p.shape)} has {ATTR}={axis!r}; the axes are "
            f"{', '.join(AXES)}"
        )
    return axis


@dataclass(frozen=True)
class GroupAxis:
    """The collectives of one axis as a parameter group sees them."""

    name: str
    shard: Comm
    """The ranks a group's partition is cut across (stage 0: whose gradients are summed)."""
    replicas: Comm | None = None
    """Ranks holding the same partition: gradients summed across them too (MiCS)."""
    disjoint: tuple[Comm, ...] = ()
    """Ranks holding *different* parameters of this kind (``ep``, ``pp``): only the gradient
    norm and the overflow flag are summed across them."""
    mirrors: tuple[Comm, ...] = ()
    """Ranks holding the same values and computing the same gradients (a replicated ``tp``):
    nothing is reduced across them; coordinate 0 writes the checkpoint."""

    def broadcast_from_first(self, t: torch.Tensor, what: str) -> None:
        """``t`` as the first rank of this axis has it, on every rank holding the same values."""
        for comm in (self.replicas, self.shard, *self.mirrors):
            if comm is not None:
                comm.broadcast(t, 0, what).wait()

    def broadcast_from(self, t: torch.Tensor, index: int, what: str) -> None:
        """``t`` as the data rank ``index`` of this axis has it (replica ``index // shard``,
        slot ``index % shard``), on every rank of its data axes (not the mirrors)."""
        reps = self.replicas.size if self.replicas is not None else 1
        if not 0 <= index < reps * self.shard.size:
            raise ValueError(
                f"modifier_rank {index} is not a data-parallel rank: the data axes have "
                f"{reps} replica(s) x {self.shard.size} rank(s) = {reps * self.shard.size}"
            )
        self.shard.broadcast(t, index % self.shard.size, what).wait()
        if self.replicas is not None:
            self.replicas.broadcast(t, index // self.shard.size, what).wait()

    @property
    def first_copy(self) -> bool:
        """Whether this rank is the first of the ranks holding its partition (it writes it)."""
        return all(c.rank == 0 for c in (self.replicas, *self.mirrors) if c is not None)


def set_cut(p: nn.Parameter, axis: GroupAxis) -> None:
    """Record how ``p`` is cut across the mesh (the engine, ``zero.Init`` and the HF loader
    do, for every parameter they place)."""
    p._z_cut = axis  # type: ignore[attr-defined]


def cut_of(p: nn.Parameter) -> GroupAxis | None:
    """How ``p`` is cut across the mesh (None: no engine or ``zero.Init`` placed it):
    :meth:`GroupAxis.broadcast_from` reaches exactly the ranks holding its values."""
    return getattr(p, "_z_cut", None)


def group_axes(mesh: Mesh) -> dict[str, GroupAxis]:
    """The axes of ``mesh`` a parameter group can be sharded over, each with the axes whose
    ranks hold different parameters (``pp``; experts: ``ep``) and those that mirror it
    (``tp``, for the parameters it does not cut; ``"tp"``: the shards it cuts, for which
    ``tp`` is disjoint)."""
    stages = (mesh.comm("pp"),) if mesh.spec.pp > 1 else ()
    mirrors = (mesh.comm("tp"),) if mesh.spec.tp > 1 else ()
    dense = GroupAxis("dp", mesh.comm("dp"), mesh.comm("dp_replicate"), stages, mirrors)
    cut = GroupAxis("tp", dense.shard, dense.replicas, (*mirrors, *stages))
    if mesh.spec.ep == 1:
        expert = GroupAxis("edp", dense.shard, dense.replicas, stages, mirrors)
    else:
        expert = GroupAxis("edp", mesh.comm("edp"), None, (mesh.comm("ep"), *stages), mirrors)
    return {"dp": dense, "tp": cut, "edp": expert}


def split_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group's parameters split by axis: dense groups first, in order, then one group
    per group holding tensor-parallel shards (same hyperparameters, ``"axis": "tp"``), then
    one per group holding expert parameters (``"axis": "edp"``)."""
    dense: list[dict[str, Any]] = []
    cut: list[dict[str, Any]] = []
    expert: list[dict[str, Any]] = []
    for g in groups:
        given = g.get("axis")
        if given is not None and given not in AXES:
            raise ValueError(f"a param group has axis {given!r}; the axes are {', '.join(AXES)}")
        by_axis: dict[str, list[nn.Parameter]] = {a: [] for a in AXES}
        for p in g["params"]:
            by_axis[param_axis(p)].append(p)
        hyper = {k: v for k, v in g.items() if k not in ("params", "axis")}
        if by_axis["dp"] or not (by_axis["tp"] or by_axis["edp"]):
            dense.append({**hyper, "params": by_axis["dp"]})
        if by_axis["tp"]:
            cut.append({**hyper, "params": by_axis["tp"], "axis": "tp"})
        if by_axis["edp"]:
            expert.append({**hyper, "params": by_axis["edp"], "axis": "edp"})
    return dense + cut + expert


def mesh_request(model: nn.Module) -> dict[str, int]:
    """The mesh sizes ``model``'s layers ask for (``mesh_axes()``), checked to agree."""
    want: dict[str, tuple[int, str]] = {}
    for name, m in model.named_modules():
        ask = getattr(m, "mesh_axes", None)
        if not callable(ask):
            continue
        for axis, size in dict(ask()).items():
            if axis not in MODEL_AXES:
                raise MeshError(
                    f"layer `{name}` ({type(m).__name__}) asks for mesh axis {axis!r}; a layer "
                    f"may size {', '.join(MODEL_AXES)}"
                )
            prev = want.get(axis)
            if prev is not None and prev[0] != size:
                raise MeshError(
                    f"layers ask for different {axis} sizes: `{prev[1]}` {prev[0]}, `{name}` "
                    f"{size}; one job has one {axis} axis, give every layer the same size"
                )
            want[axis] = (int(size), name)
    return {axis: size for axis, (size, _) in want.items()}


def bind_model(model: nn.Module, mesh: Mesh) -> None:
    """Hand ``mesh`` to every layer of ``model`` that takes it (``bind_mesh``)."""
    for m in model.modules():
        bind = getattr(m, "bind_mesh", None)
        if callable(bind):
            bind(mesh)
