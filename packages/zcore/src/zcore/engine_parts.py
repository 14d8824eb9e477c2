"""The engine's checkpoint parts besides the optimizer's shards (:mod:`zcore.checkpoint.parts`).

:class:`Counters` (the step counters), :class:`ModelState` (frozen parameters and persistent
buffers, gathered at stage 3) and :class:`RankLocalState` (a communicating optimizer's and the
collectives' per-rank error feedback), each with ``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zcore.zero.collectives import Collectives

if TYPE_CHECKING:
    from zcore.zero.communicating import CommunicatingOptimizer
    from zcore.zero.stage3 import Stage3Params


@dataclass
class Counters:
    """The step counters a checkpoint keeps (DeepSpeed's names)."""

    global_steps: int = 0
    micro_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    on_load: Callable[[int], None] | None = field(default=None, repr=False)
    """Called with ``global_steps`` after a load (the engine labels collectives with it)."""

    KEYS = ("global_steps", "micro_steps", "global_samples", "skipped_steps")

    def state_dict(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in self.KEYS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self.KEYS:
            setattr(self, k, int(state[k]))
        if self.on_load is not None:
            self.on_load(self.global_steps)


class ModelState:
    """The parameters no optimizer group holds and the persistent buffers of ``module``."""

    def __init__(
        self, module: nn.Module, trainable: Callable[[], set[int]], stage3: Stage3Params | None
    ) -> None:
        self.module = module
        self.trainable = trainable
        """The ids of the parameters the optimizer holds (asked at save time)."""
        self.stage3 = stage3

    def _sharded(self, p: nn.Parameter) -> bool:
        return self.stage3 is not None and p in self.stage3.params

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{"frozen": ..., "buffers": ...}``; collective at stage 3 (frozen parameters
        are gathered one at a time)."""
        trainable = self.trainable()
        frozen = {}
        for name, p in self.module.named_parameters():
            if id(p) in trainable:
                continue
            if self.stage3 is not None and self._sharded(p):
                self.stage3.gather([p], "gather(frozen parameter for checkpoint)")
                frozen[name] = p.data.detach().clone()
                self.stage3.release([p])
            else:
                frozen[name] = p.data.detach().clone()
        # the module's state_dict keys: non-persistent buffers (rotary caches, zmoe's idle
        # expert bias) are rebuilt by the model, and DeepSpeed does not save them either
        persistent = set(self.module.state_dict(keep_vars=True))
        buffers = {n: b.detach().clone() for n, b in self.module.named_buffers() if n in persistent}
        return {"frozen": frozen, "buffers": buffers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy ``state``'s frozen parameters and buffers in (names the model lacks are
        skipped); collective at stage 3."""
        params = dict(self.module.named_parameters())
        for name, value in state["frozen"].items():
            p = params.get(name)
            if p is None:
                continue
            if self.stage3 is not None and self._sharded(p):
                self.stage3.gather([p], "gather(frozen parameter for load)")
                p.data.copy_(value)
                self.stage3.repartition(p)
                self.stage3.release([p])
            else:
                p.data.copy_(value)
        buffers = dict(self.module.named_buffers())
        for name, value in state["buffers"].items():
            if name in buffers:
                buffers[name].copy_(value)

    def shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        params = {}
        for name, p in self.module.named_parameters():
            sharded = self.stage3 is not None and self._sharded(p)
            full = self.stage3.params[p].shape if sharded else p.shape  # type: ignore[union-attr]
            params[name] = tuple(full)
        buffers = {n: tuple(b.shape) for n, b in self.module.named_buffers()}
        return params, buffers

    def aliases(self) -> dict[str, str]:
        first: dict[int, str] = {}
        aliases = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) in first:
                aliases[name] = first[id(p)]
            else:
                first[id(p)] = name
        return aliases

    def checkpoint_names(self) -> dict[str, str]:
        """``module.checkpoint_names()`` when the model defines it (names in checkpoints)."""
        names = getattr(self.module, "checkpoint_names", None)
        return dict(names()) if callable(names) else {}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from zcore.zero import GatheredParameters

        params = list(self.module.parameters())
        with GatheredParameters(params, enabled=self.stage3 is not None):
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}


class RankLocalState:
    """Per-rank state: the communicating optimizer's (1-bit Adam's errors) and the
    collectives' (ZeRO++ LoCo). ``world`` is saved with it: another world size resets it."""

    def __init__(
        self,
        communicator: Callable[[], CommunicatingOptimizer | None],
        collectives: Collectives,
        world: int,
    ) -> None:
        self.communicator = communicator
        self.collectives = collectives
        self.world = world

    def state_dict(self) -> dict[str, Any] | None:
        talker = self.communicator()
        collectives = self.collectives.state_dict()
        if talker is None and not collectives:
            return None
        return {
            "world": self.world,
            "optimizer": talker.comm_state_dict() if talker is not None else None,
            "collectives": collectives,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        talker = self.communicator()
        if talker is not None:
            talker.load_comm_state_dict(None if state is None else state["optimizer"])
        if state is not None and state["collectives"]:
            self.collectives.load_state_dict(state["collectives"])
