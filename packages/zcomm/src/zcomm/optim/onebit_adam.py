"""1-bit Adam (Tang et al., 2021; DeepSpeed's ``OnebitAdam``), on any torch.distributed
backend.

For ``freeze_step`` steps it is Adam on gradients the engine averages in full precision
(the variance ``v`` is learned). Then ``v`` is frozen, the engine hands each rank its
local gradient, and each rank folds it into the momentum and averages the momentum with
the 1-bit compressed all-reduce (error feedback keeps what compression drops for the next
step): about 1/32 of the bytes of an fp32 all-reduce. The update is DeepSpeed's, step for
step: ``m / (sqrt(v) + eps) + weight_decay * p``, scaled by ``lr``, no bias correction.

At ZeRO stages 1-2 (DeepSpeed refuses every stage) each rank owns a slot of the momentum,
so nobody needs the whole averaged momentum: after the freeze the gradients go through a
1-bit compressed reduce-scatter instead (:mod:`zcomm.compressed_scatter`, worker error
feedback) and the owner folds its averaged slot into its momentum. With
``compressed_weight_gather`` (on by default; zstack's key) the owner then compresses its
momentum 1-bit with error feedback (the "server" half of stage 0's all-reduce) and the
weights' all-gather sends those signs and block scales instead of fp32 weights: every rank
replays each owner's update bit for bit (:mod:`zcomm.optim.momentum_gather`), so a step
costs about 1/32 of an fp32 all-reduce at stages 1-2 as at stage 0. Off, or with
non-fp32 parameters, the weights are all-gathered as ZeRO always does. During compression
each rank keeps a model-sized fp32 gradient grid until the step (stage 2's gradient
partitioning gives way to it, as in stage 1).

Differences from DeepSpeed: its first ``step`` call only allocates buffers and leaves the
weights alone (a cupy set-up step); here the first step updates them. Its error buffers
are reset on load; here they are checkpointed per rank (:mod:`zcore.checkpoint.rank_state`).
``exp_avg_mask`` (a per-parameter momentum mask in a param group) is not supported: zcore
hands the optimizer flat groups. It exists because 1-bit signs cannot say "exactly zero":
an element that never had a gradient (BERT's position embeddings past the trained length,
a token never seen) gets ``+-scale`` momentum from every compressed average, and with its
variance at 0 DeepSpeed's update then divides by ``eps`` and blows up unless the user
passes the mask. Here the mask is automatic: the momentum is zeroed where the frozen
variance is exactly 0, i.e. where no gradient was ever seen.
"""

from __future__ import annotations

from typing import Any

import torch

from zcomm.optim import momentum_gather as mg
from zcomm.optim.base import OneBitBase
from zcomm.optim.momentum_gather import ReplayedGather


class OneBitAdam(ReplayedGather, OneBitBase):
    """DeepSpeed's 1-bit Adam over zcore's flat master tensors (ZeRO stages 0-2)."""

    zero_stages = (0, 1, 2)

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        compressed_weight_gather: bool = True,
    ) -> None:
        if freeze_step < 0:
            raise ValueError(f"freeze_step must be >= 0, got {freeze_step}")
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        self.compressed_weight_gather = compressed_weight_gather
        self.freeze_step = freeze_step
        self.init_replay()

    def compressing(self) -> bool:
        """Whether the next step averages the momentum compressed (the variance is frozen)."""
        return self.completed_steps() >= self.freeze_step

    def reduce_gradients(self) -> bool:
        return not self.compressing()

    def replaying(self) -> bool:
        """Whether compressed steps replay the owners' updates on every rank (stages 1-2)."""
        return self.compressed_weight_gather and self.stage in (1, 2) and self.world > 1

    def compress_gather(self) -> bool:
        """zcore's :class:`~zcore.zero.communicating.CompressedGather`: after a compressed step."""
        return self.replaying() and self.completed_steps() > self.freeze_step

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        frozen = self.compressing()
        self.begin_step()
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                m, v, g = st["exp_avg"], st["exp_avg_sq"], p.grad
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                if not frozen:  # g is the average over ranks
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                else:
                    if self.stage == 0:  # g is this rank's own: average the momentum
                        m.copy_(self.average(m, f"exp_avg.{gi}.{pi}"))
                    # (stages 1-2: g is this slot's compressed average already)
                    m.mul_(v > 0)  # see the module docstring: where v is 0, no update
                    if self.replaying():  # the server half of stage 0's all-reduce
                        self.compress_momentum(gi, m, v > 0)
                        self.note_step(gi, group["lr"], group["weight_decay"])
                        p.copy_(
                            mg.replay(
                                p, m, v.sqrt() + group["eps"], group["lr"], group["weight_decay"]
                            )
                        )
                        continue
                update = m / (v.sqrt() + group["eps"])
                if group["weight_decay"] > 0:
                    update.add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        return loss

    def comm_state_dict(self) -> dict[str, Any]:
        return {**super().comm_state_dict(), "replay": self.replay_state()}

    def load_comm_state_dict(self, state: dict[str, Any] | None) -> None:
        super().load_comm_state_dict(state)
        self.load_replay_state(state)
