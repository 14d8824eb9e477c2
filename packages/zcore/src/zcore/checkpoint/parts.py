"""What the checkpointer knows of a training job: stateful parts and this rank's place.

The engine hands :func:`zcore.checkpoint.save` and :func:`zcore.checkpoint.load` one
:class:`CheckpointParts`; the checkpoint modules read nothing else of the engine or the
optimizer (``tests/zcore/checkpoint/test_parts_interface.py`` checks it with ``ast``). A part
that is saved whole is a :class:`Stateful` (torch's ``state_dict`` / ``load_state_dict``);
the optimizer's master weights and state are sharded across ranks and re-cut on load, so
their part (:class:`ShardedPart`) also says how each group is cut; the per-rank part
(error feedback) is saved once per global rank. A new part that is saved whole goes into
``CheckpointParts.whole`` and needs no change here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from zcore.comm import Comm
from zcore.zero.layout import GroupLayout


@runtime_checkable
class Stateful(Protocol):
    """A part saved whole (torch's ``Stateful``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ShardedPart(Protocol):
    """The optimizer's master weights and state: one slot of each group per rank."""

    layouts: list[GroupLayout]
    """Each group's cut into slots, as this job cuts it."""
    axes: list[str]
    """The axis each group is cut over (``"dp"``; experts: ``"edp"``)."""
    shard_world: int
    """Ranks the dense groups are cut across."""
    kind: str
    """The inner optimizer's class name (the kind of state it keeps)."""

    def group_rank(self, g: int) -> int:
        """This rank's slot of group ``g``."""

    def owns(self, g: int) -> bool:
        """Whether this rank writes its slot of group ``g`` (one replica of each slot)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's master (``"master"``: a list per group) and optimizer state
        (``"optimizer"``: per group), for every group."""

    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's ``param_groups`` (hyperparameters), the same on every rank."""

    def load_targets(self) -> list[torch.Tensor]:
        """The tensors a load copies this rank's master values into (maybe the live ones)."""

    def live(self) -> list[torch.Tensor]:
        """The master tensors training reads now (a load must not write them before commit)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt ``{"master": load_targets() filled, "optimizer": state_dict or None}``."""

    def after_load(self) -> None:
        """Every part is loaded: publish the master weights into the model, drop gradients."""


class ModelPart(Stateful, Protocol):
    """The model's frozen parameters and persistent buffers (``state_dict`` gathers
    stage-3 shards: collective), and what the checkpoint needs to check and name them."""

    def shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """The full shape of every parameter and of every buffer, by name."""

    def aliases(self) -> dict[str, str]:
        """Tied parameters: each later name -> the first name of the same parameter."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in its training dtype (collective: gathers stage-3 shards)."""

    def checkpoint_names(self) -> dict[str, str]:
        """The names checkpoints use for the parameters and buffers the model renames (the
        model's own ``checkpoint_names()``, e.g. a pipelined model saving under its plain
        model's names, so either loads the other's checkpoints); every other name is its
        own."""


class RankLocalPart(Protocol):
    """State that differs on every rank and belongs to no slot (error feedback)."""

    def state_dict(self) -> dict[str, Any] | None:
        """This rank's state, or None when the job keeps none."""

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Take it back; None: start it afresh (another world size, or none saved)."""


@dataclass(frozen=True)
class RankPlace:
    """This rank on the job's mesh."""

    rank: int
    """Global rank."""
    world: int
    """Ranks in the job."""
    data_world: int
    """Data-parallel ranks (``dp_replicate x dp``): the batch arithmetic's world size."""
    coords: dict[str, int]
    """This rank's coordinate on every axis of the mesh (``pp``, ``dp_replicate``, ``dp``,
    ``tp``; with experts ``ep``, ``edp``): what keys its rank file in the manifest."""
    mesh: dict[str, Any]
    """The mesh's sizes (:meth:`zcore.comm.Mesh.describe`)."""
    comm: Comm
    """Every rank of the job: the checkpointer's votes and gathers."""


@dataclass
class CheckpointParts:
    """Everything a checkpoint saves and loads, and where this rank is."""

    place: RankPlace
    counters: Stateful
    """Step counters; their ``state_dict`` keys go into the manifest (DeepSpeed's names)."""
    sharded: ShardedPart
    model: ModelPart
    per_rank: RankLocalPart
    whole: dict[str, Stateful] = field(default_factory=dict)
    """Parts saved whole: ``lr_scheduler`` (in ``common.pt``), ``loss_scaler`` (in the
    manifest), when the job has them."""
    info: dict[str, Any] = field(default_factory=dict)
    """What the manifest records for a reader: ``stage``, ``dtype``, ``config``."""
