"""Which mesh axis each parameter group is sharded and reduced over.

Dense parameters are cut across ``dp`` (and summed across ``dp_replicate`` replicas, MiCS).
A parameter tagged ``p.zero_axis = "edp"`` — an expert's, set by the MoE layer that built
it — is cut across the expert-data-parallel ranks instead: the ranks that hold the same
experts. Ranks on different ``ep`` coordinates hold *different* expert parameters, so
nothing is reduced across ``ep``; only the gradient norm and the overflow flag are summed
over it. With ``ep = 1`` the expert axis is the dense one, but expert parameters still form
groups of their own, so a checkpoint has the same groups at every ``ep``.

The engine splits each optimizer param group by axis (as DeepSpeed splits MoE parameters
into groups of their own): dense parameters keep their group, expert ones move to a new
group with the same hyperparameters and ``"axis": "edp"``, appended after every dense group.

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
AXES = ("dp", "edp")
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
    spread: Comm | None = None
    """Ranks holding *different* parameters of this axis (``ep``): only the gradient norm
    and the overflow flag are summed across them."""

    def broadcast_from_first(self, t: torch.Tensor, what: str) -> None:
        """``t`` as the first rank of this axis has it, on every rank holding the same values."""
        for comm in (self.replicas, self.shard):
            if comm is not None:
                comm.broadcast(t, 0, what).wait()


def group_axes(mesh: Mesh) -> dict[str, GroupAxis]:
    """The axes of ``mesh`` a parameter group can be sharded over."""
    dense = GroupAxis("dp", mesh.comm("dp"), mesh.comm("dp_replicate"))
    if mesh.spec.ep == 1:
        expert = GroupAxis("edp", dense.shard, dense.replicas)
    else:
        expert = GroupAxis("edp", mesh.comm("edp"), None, mesh.comm("ep"))
    return {"dp": dense, "edp": expert}


def split_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group's parameters split by axis: dense groups first, in order, then one group
    per group holding expert parameters (same hyperparameters, ``"axis": "edp"``)."""
    dense, expert = [], []
    for g in groups:
        given = g.get("axis")
        if given is not None and given not in AXES:
            raise ValueError(f"a param group has axis {given!r}; the axes are {', '.join(AXES)}")
        by_axis: dict[str, list[nn.Parameter]] = {"dp": [], "edp": []}
        for p in g["params"]:
            by_axis[param_axis(p)].append(p)
        hyper = {k: v for k, v in g.items() if k not in ("params", "axis")}
        if by_axis["dp"] or not by_axis["edp"]:
            dense.append({**hyper, "params": by_axis["dp"]})
        if by_axis["edp"]:
            expert.append({**hyper, "params": by_axis["edp"], "axis": "edp"})
    return dense + expert


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
