"""The job's device mesh: named parallel axes, built once per job on torch's ``DeviceMesh``.

Ranks are laid out outer to inner as ``pp x dp_replicate x dp x tp`` (torchtitan's
order: the axes that talk most are the innermost, i.e. the closest ranks)::

    pp            pipeline stages
    dp_replicate  replicas of the ZeRO partition (DeepSpeed's MiCS ``mics_shard_size``):
                  gradients are all-reduced across it, nothing is sharded over it
    dp            the ZeRO axis: optimizer state, gradients (stage 2+) and parameters
                  (stage 3) are cut across its ranks
    tp            tensor parallel

Two more views of the same ranks, built only when their size is above 1:

* ``dp_local``: a node-local sub-axis of ``dp`` (ZeRO++ hpZ's secondary partition,
  ``zero_hpz_partition_size``); its ranks are ``dp_local`` consecutive ``dp`` ranks.
* ``ep`` x ``edp``: the data-parallel ranks (``dp_replicate x dp``) regrouped for
  experts: ``ep`` ranks hold different experts, ``edp = dp_replicate*dp / ep`` ranks hold
  the same ones and shard them.
* ``cp``: context (sequence) parallelism, ``cp`` consecutive ``dp`` ranks that hold
  consecutive slices of the same sequences (DeepSpeed's ``sequence_parallel_size``). ZeRO
  keeps cutting across the whole ``dp`` axis, so it shards over ``dp x cp`` as DeepSpeed
  shards over its sequence-data-parallel group; the batch arithmetic counts ``dp / cp``.

:class:`MeshSpec` checks every size against the world size up front and names every
number when something does not divide; :class:`Mesh` creates the groups (nothing else in
zstack creates process groups) and hands out one bounded :class:`~zcore.comm.Comm` per
axis, so every collective keeps its timeout and its rank/op/step message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zcore.comm.accounting import TrafficTally
from zcore.comm.collectives import Comm
from zcore.comm.groups import backend_for, init_distributed

#: The axes of the main mesh, outer to inner.
AXES = ("pp", "dp_replicate", "dp", "tp")


class MeshError(ValueError):
    """Axis sizes that do not fit the world size; the message names every number."""


@dataclass(frozen=True)
class MeshSpec:
    """Axis sizes of one job, checked against its world size (build with :meth:`resolve`)."""

    world: int
    """Ranks in the job."""
    pp: int = 1
    """Pipeline stages."""
    dp_replicate: int = 1
    """Replicas of the ZeRO partition (the ranks of one replica shard the model)."""
    dp: int = 1
    """Ranks the ZeRO partition is cut across."""
    tp: int = 1
    """Tensor-parallel ranks."""
    dp_local: int = 1
    """Node-local sub-axis of ``dp`` (hpZ's secondary partition); divides ``dp``."""
    ep: int = 1
    """Expert-parallel ranks, regrouped from ``dp_replicate x dp``; divides it."""
    cp: int = 1
    """Context-parallel ranks: consecutive ``dp`` ranks holding slices of the same
    sequences; divides ``dp`` (which counts them: ZeRO cuts across ``dp x cp``)."""

    @classmethod
    def resolve(
        cls,
        world: int,
        *,
        pp: int = 1,
        tp: int = 1,
        dp: int | None = None,
        dp_local: int = 1,
        ep: int = 1,
        cp: int = 1,
    ) -> MeshSpec:
        """The spec for ``world`` ranks; ``dp=None`` gives ZeRO every data-parallel rank
        (no replicas), a smaller ``dp`` leaves ``dp_replicate`` replicas of it. ``cp``
        ranks of ``dp`` share each sequence (``dp`` counts them).

        Raises :class:`MeshError` naming every size when the product does not fit.
        """
        sizes = {"world": world, "pp": pp, "tp": tp, "dp_local": dp_local, "ep": ep, "cp": cp}
        if dp is not None:
            sizes["dp"] = dp
        bad = [f"{k} {v}" for k, v in sizes.items() if not isinstance(v, int) or v < 1]
        if bad:
            raise MeshError(f"mesh sizes must be positive integers: {', '.join(bad)}")
        if world % (pp * tp):
            raise MeshError(
                f"world size {world} is not divisible by pp {pp} x tp {tp} = {pp * tp}; "
                "choose pipeline and tensor-parallel sizes whose product divides the world size"
            )
        data = world // (pp * tp)
        shard = data if dp is None else dp
        if data % shard:
            raise MeshError(
                f"the ZeRO axis dp {shard} (mics_shard_size) does not divide the "
                f"data-parallel ranks: world size {world} / (pp {pp} x tp {tp}) = {data}; "
                f"choose a dp that divides {data}"
            )
        if shard % cp:
            raise MeshError(
                f"sequence_parallel_size cp {cp} does not divide the ZeRO axis dp {shard} "
                f"(world size {world} / (pp {pp} x tp {tp} x dp_replicate {data // shard})); "
                f"choose a cp that divides {shard}, or launch a multiple of {cp * pp * tp} ranks"
            )
        spec = cls(world, pp, data // shard, shard, tp, dp_local, ep, cp)
        if shard % dp_local:
            raise MeshError(
                f"the node-local sub-axis dp_local {dp_local} (zero_hpz_partition_size) does "
                f"not divide dp {shard} (world size {world} = {spec.formula()}); choose one "
                f"that divides {shard}, e.g. the ranks per node"
            )
        if data % ep:
            raise MeshError(
                f"expert-parallel ep {ep} does not divide the data-parallel ranks "
                f"dp_replicate {spec.dp_replicate} x dp {shard} = {data} "
                f"(world size {world} = {spec.formula()}); choose an ep that divides {data}"
            )
        return spec

    def __post_init__(self) -> None:
        if self.pp * self.dp_replicate * self.dp * self.tp != self.world:
            raise MeshError(f"world size {self.world} != {self.formula()}")

    def formula(self) -> str:
        """``pp 1 x dp_replicate 2 x dp 2 x tp 1 = 4``: the product, every factor named."""
        product = self.pp * self.dp_replicate * self.dp * self.tp
        text = " x ".join(f"{a} {getattr(self, a)}" for a in AXES) + f" = {product}"
        return (
            text
            if self.cp == 1
            else f"{text}, dp {self.dp} = data {self.dp // self.cp} x cp {self.cp}"
        )

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data: ``dp_replicate x dp / cp``."""
        return self.dp_replicate * self.dp // self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: ranks holding the same experts."""
        return self.dp_replicate * self.dp // self.ep

    def sizes(self) -> dict[str, int]:
        """Every axis and view with its size (what a checkpoint manifest records)."""
        return {
            **{a: getattr(self, a) for a in AXES},
            "dp_local": self.dp_local,
            "ep": self.ep,
            "edp": self.edp,
            "cp": self.cp,
        }


def spec_from_config(config: Any, world: int, ep: int = 1, pp: int = 1) -> MeshSpec:
    """The mesh a :class:`~zcore.config.ZConfig` asks for on ``world`` ranks.

    ``zero_optimization.mics_shard_size`` (DeepSpeed's MiCS; -1: every rank) sizes ``dp``
    and leaves the rest as replicas; ``zero_hpz_partition_size`` sizes ``dp_local``;
    ``sequence_parallel_size`` sizes ``cp`` (inside ``dp``). ``ep``
    comes from the model (its MoE layers' ``ep_size``, as in DeepSpeed, not the config), and
    so does ``pp`` (a ``zcore.pipe.PipelineModule``'s ``num_stages``).
    ``tensor_parallel.autotp_size`` (DeepSpeed's AutoTP key) sizes ``tp``.
    """
    zc = config.zero_optimization
    mics = int(getattr(zc, "mics_shard_size", -1) or -1)
    hpz = getattr(zc, "zero_hpz_partition_size", None)
    if hpz is None and hasattr(config, "extension"):  # a gated key zcomm unlocks
        hpz = config.extension("zero_optimization.zero_hpz_partition_size")
    hpz = int(hpz or 1)
    cp = int(getattr(config, "sequence_parallel_size", 1) or 1)
    block = config.extension("tensor_parallel") if hasattr(config, "extension") else None
    tp = int(block.autotp_size) if block is not None else 1
    try:
        return MeshSpec.resolve(
            world, pp=pp, tp=tp, dp=None if mics <= 0 else mics, dp_local=hpz, ep=ep, cp=cp
        )
    except MeshError as err:
        raise MeshError(
            f"{err} (zero_optimization: mics_shard_size {mics}, "
            f"zero_hpz_partition_size {hpz}; sequence_parallel_size {cp}; "
            f"tensor_parallel.autotp_size {tp}; "
            f"the model's ep_size {ep}, pipeline stages pp {pp})"
        ) from None


def mesh_for_config(
    config: Any,
    device: torch.device | str | None = None,
    ep: int = 1,
    spec: MeshSpec | None = None,
) -> Mesh:
    """Join the job (if launched) and return its mesh as ``config`` (and the model's
    expert-parallel size ``ep``) sizes it (shared); ``spec`` gives every axis size instead
    (axes the config cannot size yet: ``pp``, ``tp``), and must agree with ``ep``."""
    backend = None if device is None else backend_for(device)
    world = dist.get_world_size() if init_distributed(config.comm_timeout_s, backend) else 1
    if spec is None:
        spec = spec_from_config(config, world, ep)
    elif spec.ep != ep:
        raise MeshError(
            f"the mesh has ep {spec.ep} but the model's MoE layers ask for ep_size {ep}; "
            f"build the MeshSpec with ep={ep}"
        )
    return job_mesh(spec, config.comm_timeout_s, device)


@dataclass
class Mesh:
    """The built mesh of this rank: a ``DeviceMesh`` and one :class:`Comm` per axis.

    On a single process without ``torch.distributed`` every axis has size 1 and every
    collective is a no-op (no groups exist).
    """

    spec: MeshSpec
    rank: int
    """This rank in the job (``torch.distributed`` global rank)."""
    timeout_s: float
    device_mesh: Any = None
    """torch's ``DeviceMesh`` over the non-trivial axes (``dp`` always), or None."""
    expert_mesh: Any = None
    """torch's ``DeviceMesh`` ``(pp, edp, ep, tp)`` when ``ep > 1``."""
    local_mesh: Any = None
    """torch's ``DeviceMesh`` splitting ``dp`` into ``(dp_node, dp_local)`` when hpZ is on."""
    context_mesh: Any = None
    """torch's ``DeviceMesh`` splitting ``dp`` into ``(dp_data, cp)`` when ``cp > 1``."""
    _comms: dict[str, Comm] = field(default_factory=dict)

    @classmethod
    def build(
        cls, spec: MeshSpec | None, timeout_s: float, device: torch.device | str | None = None
    ) -> Mesh:
        """Join the job's process group (if launched) and create every group of ``spec``.

        ``spec=None`` is plain data parallelism over every rank. Collective: every rank
        builds the same mesh in the same order. Raises :class:`MeshError` when ``spec``
        was made for another world size.
        """
        backend = None if device is None else backend_for(device)
        if not init_distributed(timeout_s, backend):
            if spec is not None and spec.world != 1:
                raise MeshError(
                    f"the mesh is for {spec.world} ranks ({spec.formula()}) but this is a "
                    "single process; start it with `z launch --nproc N` or torchrun"
                )
            return cls(MeshSpec(1), 0, timeout_s)
        world = dist.get_world_size()
        spec = spec or MeshSpec.resolve(world)
        if spec.world != world:
            raise MeshError(
                f"the mesh is for world size {spec.world} ({spec.formula()}) but the job has "
                f"{world} ranks; size the mesh for {world}"
            )
        kind = torch.device(device).type if device is not None else "cpu"
        from torch.distributed.device_mesh import init_device_mesh

        names = tuple(a for a in AXES if a == "dp" or getattr(spec, a) > 1)
        shape = tuple(getattr(spec, a) for a in names)
        mesh = cls(spec, dist.get_rank(), timeout_s)
        mesh.device_mesh = init_device_mesh(kind, shape, mesh_dim_names=names)
        if spec.ep > 1:
            mesh.expert_mesh = init_device_mesh(
                kind,
                (spec.pp, spec.edp, spec.ep, spec.tp),
                mesh_dim_names=("pp", "edp", "ep", "tp"),
            )
        if spec.dp_local > 1:
            outer = (spec.pp, spec.dp_replicate, spec.dp // spec.dp_local, spec.dp_local, spec.tp)
            mesh.local_mesh = init_device_mesh(
                kind, outer, mesh_dim_names=("pp", "dp_replicate", "dp_node", "dp_local", "tp")
            )
        if spec.cp > 1:
            outer = (spec.pp, spec.dp_replicate, spec.dp // spec.cp, spec.cp, spec.tp)
            mesh.context_mesh = init_device_mesh(
                kind, outer, mesh_dim_names=("pp", "dp_replicate", "dp_data", "cp", "tp")
            )
        return mesh

    # -- axes -----------------------------------------------------------------------------
    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of ``axis`` that holds this rank (None on a single process)."""
        if axis == "world":
            return dist.group.WORLD if self.device_mesh is not None else None
        mesh = self._mesh_of(axis)
        if mesh is None:
            return None
        return mesh.get_group(axis)

    def _mesh_of(self, axis: str) -> Any:
        if axis in ("ep", "edp"):
            return self.expert_mesh
        if axis == "dp_local":
            return self.local_mesh
        if axis == "cp":
            return self.context_mesh
        if axis not in AXES:
            views = ", ".join((*AXES, "dp_local", "ep", "edp", "cp", "world"))
            raise MeshError(f"no mesh axis {axis!r}; the axes are {views}")
        if self.device_mesh is None or axis not in (self.device_mesh.mesh_dim_names or ()):
            return None  # an axis of size 1
        return self.device_mesh

    def size(self, axis: str) -> int:
        return self.spec.world if axis == "world" else self.spec.sizes()[axis]

    def coordinate(self, axis: str) -> int:
        """This rank's index along ``axis``."""
        if axis == "world":
            return self.rank
        group = self.group(axis)
        return 0 if group is None else dist.get_rank(group)

    def coords(self) -> dict[str, int]:
        """This rank's index on every axis of size above 1 (checkpoint manifests record it)."""
        names = [*AXES, "dp_local", *(("ep", "edp") if self.spec.ep > 1 else ())]
        return {a: self.coordinate(a) for a in names if self.size(a) > 1}

    def full_coords(self) -> dict[str, int]:
        """This rank's index on every main axis (``pp``, ``dp_replicate``, ``dp``, ``tp``,
        size 1 included) and, with experts, on ``ep`` and ``edp``: the key of its
        checkpoint rank file, unique per rank."""
        names = [*AXES, *(("ep", "edp") if self.spec.ep > 1 else ())]
        return {a: self.coordinate(a) for a in names}

    @property
    def node_size(self) -> int:
        """Ranks per node: what counts as "intra-node" for hpZ, qgZ and byte accounting.

        ``dp_local`` when hpZ sets it (on one machine the "nodes" are groups of ranks the
        mesh gives), else ``LOCAL_WORLD_SIZE`` (set by ``z launch`` and torchrun, one per
        machine), else the whole job. Nodes are runs of consecutive global ranks.
        """
        if self.spec.dp_local > 1:
            return self.spec.dp_local
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        return local if local > 0 and self.spec.world % local == 0 else self.spec.world

    def node_of(self, rank: int) -> int:
        """The node global rank ``rank`` runs on (see :attr:`node_size`)."""
        return rank // self.node_size

    @property
    def data_rank(self) -> int:
        """This rank's index among the ranks that see different data (``dp_replicate x dp``,
        the ``cp`` ranks of one sequence counting once)."""
        dp = self.coordinate("dp_replicate") * self.spec.dp + self.coordinate("dp")
        return dp // self.spec.cp

    def comm(self, axis: str) -> Comm:
        """The bounded collectives over ``axis`` (one per axis, kept)."""
        comm = self._comms.get(axis)
        if comm is None:
            group = self.group(axis)
            size = self.size(axis)
            if group is None and size > 1:
                raise MeshError(f"axis {axis} of size {size} has no process group on this rank")
            label = None if axis == "world" or size == self.spec.world else axis
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            comm = Comm(
                group,
                self.coordinate(axis),
                size,
                self.timeout_s,
                axis=label,
                ranks=ranks,
                node_size=self.node_size,
            )
            self._comms[axis] = comm
        return comm

    def traffic(self) -> TrafficTally:
        """Bytes this rank has sent through every axis's comm so far, per op kind, each
        split into intra-node and inter-node (:mod:`zcore.comm.accounting`); subtract an
        earlier tally (``now.minus(before)``) for what one step sent."""
        tally = TrafficTally()
        for comm in self._comms.values():
            tally.add(comm.traffic)
        return tally

    def broadcast_from_first(self, t: torch.Tensor, what: str) -> None:
        """``t`` as the first data-parallel rank has it, on every data-parallel rank: across
        replicas first, then along the ZeRO axis from its first rank."""
        for axis in ("dp_replicate", "dp"):
            self.comm(axis).broadcast(t, 0, what).wait()

    def set_step(self, step: int) -> None:
        """Label every axis's next collectives with training step ``step``."""
        for comm in self._comms.values():
            comm.step = step

    def describe(self) -> dict[str, Any]:
        """The sizes of every axis, for checkpoint manifests and logs."""
        return {"world": self.spec.world, **self.spec.sizes()}


_shared: dict[tuple[MeshSpec | None, str], tuple[Any, Mesh]] = {}


def job_mesh(
    spec: MeshSpec | None, timeout_s: float, device: torch.device | str | None = None
) -> Mesh:
    """The job's mesh for ``spec``, built on first use and then shared.

    ``zero.Init``, ``zcore.initialize`` and checkpoints ask for the same spec and get the
    same groups (a process group is created once per job, not once per caller). A mesh
    built before ``destroy_process_group`` is never handed out again.
    """
    kind = torch.device(device).type if device is not None else "cpu"
    key = (spec, kind)
    hit = _shared.get(key)
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if hit is not None and hit[0] is world and world is not None:
        hit[1].timeout_s = timeout_s
        for comm in hit[1]._comms.values():
            comm.timeout_s = timeout_s
        return hit[1]
    mesh = Mesh.build(spec, timeout_s, device)
    if mesh.device_mesh is not None:
        if spec is None:  # plain data parallelism: the resolved spec names the same mesh
            _shared[(mesh.spec, kind)] = (dist.group.WORLD, mesh)
        _shared[key] = (dist.group.WORLD, mesh)
    return mesh
