"""0/1 Adam (Lu et al., 2022; DeepSpeed's ``ZeroOneAdam``), on any torch.distributed backend.

Two savings over 1-bit Adam, both following DeepSpeed's ``zoadam.py`` step for step:

1. **Variance updates get rarer.** Until ``var_freeze_step`` the variance is updated only
   every ``var_interval`` steps, from gradients the engine averages in full precision; the
   interval starts at 1 and doubles after every ``var_update_scaler`` updates. On the other
   steps each rank's gradient is averaged 1-bit compressed into the momentum.
2. **Local steps.** After ``var_freeze_step`` the variance is frozen and ranks stop talking
   for ``local_step_interval`` steps at a time (1, doubling every ``local_step_scaler``
   steps, at most ``local_step_clipper``): each updates its own weights with its own
   momentum and records the updates in an accumulator. At a synchronization it undoes
   them, averages the accumulator (scaled by ``sqrt(v) + eps``) 1-bit compressed, and
   applies the average; the momentum becomes the average update over the summed learning
   rates.

Between synchronizations the weights, the momentum and the accumulator differ per rank:
checkpoints keep each rank's (:meth:`comm_state_dict`), so save, load, continue is the
uninterrupted run. DeepSpeed's first ``step`` only allocates buffers; here it updates.
As in :mod:`zcomm.optim.onebit_adam`, the momentum is masked where the variance is still
exactly 0 (DeepSpeed's ``exp_avg_mask``, made automatic): 1-bit signs give such elements
``+-scale``, which over ``eps`` would blow the weights up.

``preconditioned: true`` (zstack's key; default false, DeepSpeed's update) compresses
``g / (sqrt(v) + eps)`` on the steps before the freeze that skip the variance, and
multiplies the average back. DeepSpeed's raw-gradient compression gives every element one
sign scale, so an embedding row that saw no gradient gets the largest elements' noise over
its own tiny variance; on `z train` preconditioning ended much closer to Adam's validation
loss (``benchmarks/results/zero-one-adam.md``).

**ZeRO stages 1-2** (DeepSpeed refuses every stage). With fp32 parameters (`z train`'s
default) the stage 0 algorithm runs on ``(world, P)`` grids and the weights' all-gather is
computed, not sent (:mod:`zcomm.optim.zero_one_replica`): stage 0's bytes, with the
master weights partitioned and the momentum and variance held whole, as at stage 0.

With bf16/fp16 parameters the model cannot hold the master's values, so ZeRO's weight
all-gather stays and every rank runs the same model; each slot is stepped by its owner
with the owner's own local gradient. Once the variance is frozen, the momentum and the
weights are *linear* in the gradients, so each rank keeps two running sums of its local
gradient grid, ``A = beta1 * A + g`` and ``B = B + lr * A``. At a synchronization both go
through the 1-bit compressed reduce-scatter, and the owner adds
``(1 - beta1) * (mean(A) - A_own)`` to its momentum and subtracts
``(1 - beta1) * (mean(B) - B_own) / (sqrt(v) + eps)`` from its weights. That lands both
exactly where momentum steps on the rank-averaged gradients would have put them (weight
decay aside). DeepSpeed's synchronization restores the same weights and approximates the
momentum; here the momentum is exact too. The cost: two compressed reduce-scatters per
interval, the fp32 weight all-gather every step, and two model-sized fp32 grids per rank,
saved in checkpoints with the error buffers. Before the freeze the non-variance steps
reduce-scatter the gradients 1-bit compressed.
"""

from __future__ import annotations

from typing import Any

import torch

from zcomm.optim.base import OneBitBase
from zcomm.optim.zero_one_replica import ReplicatedLocalSteps


class ZeroOneAdam(ReplicatedLocalSteps, OneBitBase):
    """DeepSpeed's 0/1 Adam over zcore's flat master tensors (ZeRO stages 0-2)."""

    zero_stages = (0, 1, 2)

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        preconditioned: bool = False,
        compressed_weight_gather: bool = False,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        if compressed_weight_gather:
            raise ValueError(
                "optimizer.params.compressed_weight_gather is supported by OneBitAdam only: "
                "replaying 0/1 Adam's 1-bit updates diverged on z train after the variance "
                "froze (tiny, stage 2, measured); remove it"
            )
        self.compressed_weight_gather = False
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.preconditioned = preconditioned
        self.frozen = False
        self.accumulator: dict[torch.Tensor, torch.Tensor] = {}
        """Per master tensor: this rank's updates since the last synchronization (DeepSpeed's
        ``momentum_accumulator``; kept out of ``state``, which rank 0 alone saves)."""
        self.sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Stages 1-2, per group: this rank's ``(A, B)`` gradient sums since the last
        synchronization, ``(world, P)`` each (see the module docstring)."""
        self._grids: dict[int, torch.Tensor] = {}
        self.init_replica()

    def _first_state(self) -> dict[str, Any]:
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p):
                    return self.state[p]
        return {}

    def after_load(self) -> None:
        super().after_load()
        self.frozen = self.completed_steps() > self.var_freeze_step

    def reduce_gradients(self) -> bool:
        if self.frozen:
            return False
        st = self._first_state()
        return (int(st.get("step", 0)) + 1) % int(st.get("var_interval", 1)) == 0

    def reduce_scatter_local(self, grid: torch.Tensor, key: str) -> torch.Tensor:
        """Before the freeze: 1-bit Adam's compressed reduce-scatter. After it: no
        communication here; this rank's own row (a local step) and the grid kept for
        :meth:`_sum_and_sync` in the step, which sees the gradient's final scale."""
        gi = int(key.rsplit(".", 1)[1])
        if self.replicated():
            return self.replica_scatter(grid, gi, key)
        if not self.frozen:
            if not self.preconditioned:
                return super().reduce_scatter_local(grid, key)
            return self.preconditioned_scatter(grid, key)
        self._grids[gi] = grid
        return grid[self.context.comm.rank if self.context else 0].clone()

    def _sum_and_sync(
        self,
        gi: int,
        p: torch.Tensor,
        st: dict[str, Any],
        denom: torch.Tensor,
        beta1: float,
        lr: float,
    ) -> None:
        """Stages 1-2 after the freeze: fold this step's local grid into ``(A, B)``; at a
        synchronization average them compressed and correct the momentum and weights."""
        grid = self._grids.pop(gi)
        rank = self.context.comm.rank if self.context else 0
        own = grid[rank]
        # the step's gradient is own row times one scalar (loss-scale, clipping): apply it
        # to the whole grid so the sums are in the step's units
        norm_sq = float(torch.dot(own, own))
        factor = float(torch.dot(p.grad, own)) / norm_sq if norm_sq > 0 else 1.0
        if gi not in self.sums:
            self.sums[gi] = (torch.zeros_like(grid), torch.zeros_like(grid))
        a_sum, b_sum = self.sums[gi]
        a_sum.mul_(beta1).add_(grid, alpha=factor)
        b_sum.add_(a_sum, alpha=lr)
        if st["step"] % st["local_step_interval"] != 0:
            return
        assert self.scatter is not None, "bind() first"
        a_mean, b_mean = self.scatter(a_sum, f"A.{gi}"), self.scatter(b_sum, f"B.{gi}")
        m, v = st["exp_avg"], st["exp_avg_sq"]
        m.add_(a_mean - a_sum[rank], alpha=1 - beta1).mul_(v > 0)
        p.sub_((b_mean - b_sum[rank]).mul_(v > 0) / denom, alpha=1 - beta1)
        a_sum.zero_()
        b_sum.zero_()

    def drifting(self) -> bool:
        """Whether local steps have happened since the last synchronization."""
        return any(float(self.state[p].get("lrs", 0.0)) != 0.0 for p in self.accumulator)

    def _update(
        self,
        gi: int,
        p: torch.Tensor,
        st: dict[str, Any],
        acc: torch.Tensor | None,
        beta1: float,
        lr: float,
        eps: float,
        wd: float,
        key: str,
    ) -> None:
        """Stage 0, and stages 1-2 with non-fp32 parameters: the update of master ``p``."""
        m, v = st["exp_avg"], st["exp_avg_sq"]
        denom = v.sqrt().add_(eps)
        update = m / denom
        if wd > 0:
            update.add_(p, alpha=wd)
        p.add_(update, alpha=-lr)
        if self.frozen and self.stage > 0:
            self._sum_and_sync(gi, p, st, denom, beta1, lr)
        elif self.frozen:
            assert acc is not None
            acc.add_(update, alpha=-lr)
            if st["step"] % st["local_step_interval"] == 0:  # synchronize
                p.sub_(acc)
                acc.mul_(denom)
                acc.copy_(self.average(acc, key)).mul_(v > 0)
                m.copy_(acc / st["lrs"]).neg_()
                p.add_(acc / denom)
                acc.zero_()
                st["lrs"] = 0.0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                key = f"{gi}.{pi}"
                st = self.state[p]
                if not st:
                    st.update(
                        step=0,
                        var_interval=1,
                        var_counter=0,
                        local_step_interval=1,
                        local_step_counter=0,
                        lrs=0.0,
                    )
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                acc = self.accumulator.get(p)
                if acc is None and self.stage == 0:
                    acc = self.accumulator[p] = torch.zeros_like(p)
                m, v, g = st["exp_avg"], st["exp_avg_sq"], p.grad
                st["step"] += 1
                if self.replicated():  # stages 1-2, fp32: see zero_one_replica
                    self.replica_step(gi, p, st, group)
                elif not self.frozen:
                    if st["step"] % st["var_interval"] == 0:  # g averaged in full precision
                        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                        self._d_grids.pop(gi, None)
                        m.mul_(beta1).add_(g, alpha=1 - beta1)
                    else:  # g is this rank's own (stage 0: average it) or averaged 1-bit
                        if self.stage > 0:
                            avg = g
                        elif self.preconditioned:  # compress g / sqrt(v): see the key's doc
                            d, seen = v.sqrt().add_(eps), v > 0  # no 1/eps: see base
                            avg = self.average((g / d).mul_(seen), key).mul_(d).mul_(seen)
                        else:
                            avg = self.average(g, key)
                        m.mul_(beta1).add_(avg, alpha=1 - beta1)
                        m.mul_(v > 0)  # no variance measured yet: no momentum (1-bit Adam's mask)
                else:
                    m.mul_(beta1).add_(g, alpha=1 - beta1)
                    st["lrs"] += lr if self.stage == 0 else 0.0
                if not self.replicated():
                    self._update(gi, p, st, acc, beta1, lr, eps, wd, key)
                if not self.frozen:
                    if st["step"] % st["var_interval"] == 0:
                        st["var_counter"] += 1
                        if st["var_counter"] == self.var_update_scaler:
                            st["var_counter"] = 0
                            st["var_interval"] *= 2
                else:
                    st["local_step_counter"] += 1
                    if st["local_step_counter"] == self.local_step_scaler:
                        st["local_step_counter"] = 0
                        st["local_step_interval"] = min(
                            self.local_step_clipper, st["local_step_interval"] * 2
                        )
        if not self.frozen and self.completed_steps() > self.var_freeze_step:
            self.frozen = True
            if self.allreduce is not None:  # the errors were of gradients; now of updates
                self.allreduce.reset()
        return loss

    # -- per-rank state: error feedback, and the drift of local steps ------------------------
    def comm_state_dict(self) -> dict[str, Any]:
        state = super().comm_state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        state["accumulator"] = [
            self.accumulator[p].clone() if p in self.accumulator else None for p in params
        ]
        state["sums"] = {gi: (a.clone(), b.clone()) for gi, (a, b) in self.sums.items()}
        if self.replicated():
            state["replica"] = self.replica_state()
        if self.drifting():  # weights and momentum differ per rank until the next sync
            state["master"] = [p.detach().clone() for p in params]
            state["exp_avg"] = [self.state[p]["exp_avg"].clone() for p in params]
        return state

    def load_comm_state_dict(self, state: dict[str, Any] | None) -> None:
        super().load_comm_state_dict(state)
        params = [p for group in self.param_groups for p in group["params"]]
        self.accumulator.clear()
        self.sums.clear()
        self.load_replica_state(state)
        if state is not None:
            self.sums = {
                int(gi): (a.clone(), b.clone()) for gi, (a, b) in state.get("sums", {}).items()
            }
        if state is None:
            for p in params:  # another world size: drop the local drift (lrs restarts)
                if self.state.get(p):
                    self.state[p]["lrs"] = 0.0
            return
        for p, acc in zip(params, state["accumulator"], strict=True):
            if acc is not None:
                self.accumulator[p] = acc.to(p.device, p.dtype).clone()
        if "master" in state:
            with torch.no_grad():
                for p, mine, m in zip(params, state["master"], state["exp_avg"], strict=True):
                    p.copy_(mine)
                    self.state[p]["exp_avg"].copy_(m)
