"""The optimizer's master weights and state as a checkpoint part (sharded, re-cut on load).

:class:`OptimizerShards` is what the checkpointer sees of a :class:`ZeroOptimizer`
(:class:`zcore.checkpoint.parts.ShardedPart`): how each group is cut, this rank's slots and
state, and the load hand-off. Where the values live is the store's business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zcore.zero.layout import GroupLayout

if TYPE_CHECKING:
    from zcore.zero.optimizer import ZeroOptimizer


class OptimizerShards:
    """A :class:`~zcore.checkpoint.parts.ShardedPart` over one rank's ``ZeroOptimizer``."""

    def __init__(self, zopt: ZeroOptimizer) -> None:
        self._zopt = zopt

    @property
    def layouts(self) -> list[GroupLayout]:
        return self._zopt.layouts

    @property
    def axes(self) -> list[str]:
        return self._zopt.group_axis

    @property
    def shard_world(self) -> int:
        return self._zopt.shard_world

    @property
    def kind(self) -> str:
        return type(self._zopt.optimizer).__name__

    def group_rank(self, g: int) -> int:
        return self._zopt.group_rank(g)

    def owns(self, g: int) -> bool:
        return self._zopt.owns_group(g)

    def state_dict(self) -> dict[str, Any]:
        return {
            "master": self._zopt.master_for_save(),
            "optimizer": self._zopt.optimizer_state_for_save(),
        }

    def param_groups(self) -> list[dict[str, Any]]:
        return self._zopt.optimizer.state_dict()["param_groups"]

    def load_targets(self) -> list[torch.Tensor]:
        return self._zopt.master_for_load()

    def live(self) -> list[torch.Tensor]:
        return self._zopt.master

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._zopt.finish_load(state["master"], state["optimizer"])

    def after_load(self) -> None:
        self._zopt.publish()
        self._zopt.zero_grad()
