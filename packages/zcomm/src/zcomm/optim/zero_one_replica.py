"""0/1 Adam at ZeRO stages 1-2 with fp32 parameters: stage 0's algorithm, owner slots kept.

0/1 Adam's two savings both need every rank to update *every* weight itself: the
compressed steps before the freeze average a gradient every rank then applies, and the
local steps after it let each rank drift on its own momentum until the next
synchronization. ZeRO's weight all-gather after every step would undo both (it costs an
fp32 all-reduce's second half, more than everything 0/1 Adam sends). So with fp32
parameters, where zcore's :class:`~zcore.zero.communicating.CompressedGather` fills every
chunk of that all-gather, this mixin runs stage 0's 0/1 Adam on ``(world, P)`` grids of
the whole group and *computes* the all-gather instead of sending it:

* before the freeze, a variance step all-gathers the fp32-averaged gradient slots (what
  ZeRO's reduce-scatter gave each owner; together the two cost what stage 0's fp32
  all-reduce does); a compressed step averages the whole local gradient grid with stage
  0's 1-bit all-reduce (``g / (sqrt(v) + eps)`` when ``preconditioned``). Every rank then
  holds the same averaged gradient, updates the same momentum and variance grids, and
  replays every slot's update on the weights it holds: the ranks stay bit-identical;
* after the freeze, each rank steps every slot with its own momentum (a local step, no
  communication), keeping the running sums of its local gradients ``A = beta1 * A + g``
  and ``B = (1 - lr * wd) * B + lr * A``. With the variance frozen the weights are linear
  in the gradients, so after ``k`` local steps from the interval's start ``(x_s, m_s)``
  (the same on every rank) they are ``alpha * x_s - (P * m_s + (1 - beta1) * B) / d``,
  with scalars ``alpha`` (weight decay) and ``P`` every rank shares. At a synchronization
  ``A`` and ``B`` are averaged 1-bit compressed (two of stage 0's all-reduces) and every
  rank evaluates the same formula with the averages: the weights and momentum land where
  steps on the rank-averaged gradients would have put them, bit-identical on every rank
  (stage 0's accumulator average recovers the weights only, and leaves rounding
  differences between ranks);
* the clipping factor a compressed step's gradient carries (the engine hands back the
  owner's row scaled by it) is agreed over the ranks with one 2-element all-reduce, so
  every rank scales the grid by the same float.

Measured loss and bytes against Adam and 1-bit Adam: ``benchmarks/results/zero-one-adam.md``.

Wire bytes are stage 0's (plus the second all-reduce per synchronization), not ZeRO's.
The price is memory: the momentum, the variance and the two sums are ``(world, P)``
grids on every rank, as at stage 0 (the fp32 master weights stay partitioned). Between synchronizations the ranks hold different
models, so a checkpoint keeps each rank's rows, and zcore's publish after a load takes
them back (``restored_slots``): save, load, continue is the uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import torch

from zcomm.optim.momentum_gather import replay


class ReplicatedLocalSteps:
    """The stage 1-2 fp32 path of :class:`~zcomm.optim.zero_one_adam.ZeroOneAdam`."""

    def init_replica(self) -> None:
        self.grids: dict[int, dict[str, torch.Tensor]] = {}
        """Per group: the momentum ``m``, variance ``v`` and gradient sums ``A``, ``B``,
        ``(world, P)`` each."""
        self._grad: dict[int, torch.Tensor] = {}
        self._pending: dict[int, tuple[Any, ...]] = {}
        self.drift: dict[int, tuple[int, float, float]] = {}
        """Per group, since the last synchronization: local steps ``k``, the weights' decay
        ``alpha`` and the start momentum's coefficient ``P`` (see :meth:`_drifted`)."""

    def replicated(self) -> bool:
        """Whether the stage 1-2 fp32 path runs (else the gradient-sum path)."""
        ctx = self.context  # type: ignore[attr-defined]
        return ctx is not None and ctx.stage in (1, 2) and ctx.comm.size > 1 and ctx.fp32_params

    def compress_gather(self) -> bool:
        """zcore's :class:`~zcore.zero.communicating.CompressedGather`: every publish."""
        return self.replicated()

    # -- gradients -----------------------------------------------------------------------
    def replica_scatter(self, grid: torch.Tensor, gi: int, key: str) -> torch.Tensor:
        """Before the freeze: the whole grid averaged 1-bit (stage 0's all-reduce); after:
        the local grid itself. Kept for the step; this rank's row returned."""
        rank = self.context.comm.rank  # type: ignore[attr-defined]
        if not self.frozen:  # type: ignore[attr-defined]
            world, n = grid.shape
            if self.preconditioned:  # type: ignore[attr-defined]
                p = self.param_groups[gi]["params"][0]  # type: ignore[attr-defined]
                st = self.state[p]  # type: ignore[attr-defined]
                self._full_grids(gi, p, st, int(st.get("step", 0)))  # built here after a load
                d, seen = self._denominators(gi, slice(0, n))
                avg = self.average((grid / d).mul_(seen).view(-1), key)  # type: ignore[attr-defined]
                grid = avg.view(world, n).mul_(d).mul_(seen)
            else:
                grid = self.average(grid.reshape(-1), key).view(world, n)  # type: ignore[attr-defined]
        self._grad[gi] = grid
        return grid[rank].clone()

    def _agreed_factor(self, grad: torch.Tensor, own: torch.Tensor, gi: int) -> float:
        """The scalar the engine multiplied ``own`` by (loss scale, clipping), the same
        float on every rank."""
        t = torch.stack([torch.dot(grad, own), torch.dot(own, own)]).double()
        comm = self.context.comm  # type: ignore[attr-defined]
        comm.all_reduce(t, f"all_reduce(0/1 Adam gradient scale of group {gi})").wait()
        return float(t[0] / t[1]) if float(t[1]) > 0 else 1.0

    def _full_grids(
        self, gi: int, p: torch.Tensor, st: dict[str, Any], taken: int
    ) -> dict[str, torch.Tensor]:
        """Group ``gi``'s grids; built on first use, from every rank's slot state when that
        state has ``taken`` steps in it (a checkpoint without this rank's grids)."""
        grids = self.grids.get(gi)
        if grids is None:  # first step, or a checkpoint without this rank's grids
            comm = self.context.comm  # type: ignore[attr-defined]
            grids = {}
            for name, mine in (("m", st["exp_avg"]), ("v", st["exp_avg_sq"])):
                full = torch.zeros(comm.size, p.numel(), dtype=torch.float32, device=p.device)
                if taken > 0:  # a loaded slot state: every rank's, once
                    comm.all_gather(
                        full.view(-1),
                        mine.reshape(-1).float(),
                        f"all_gather(0/1 Adam {name} of group {gi})",
                    ).wait()
                grids[name] = full
            grids["A"] = torch.zeros_like(grids["m"])
            grids["B"] = torch.zeros_like(grids["m"])
            if self.frozen:  # type: ignore[attr-defined]  # the masters are the interval's start
                grids["x"] = torch.empty_like(grids["m"])
                comm.all_gather(
                    grids["x"].view(-1),
                    p.detach().reshape(-1).float(),
                    f"all_gather(0/1 Adam weights of group {gi})",
                ).wait()
            self.grids[gi] = grids
        return grids

    def _denominators(self, gi: int, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """``sqrt(v) + eps`` of columns ``cols`` of every slot (1 where ``v`` is 0), and
        where ``v > 0``."""
        v = self.grids[gi]["v"][:, cols]
        seen = v > 0
        eps = self.param_groups[gi]["eps"]  # type: ignore[attr-defined]
        return torch.where(seen, v.sqrt().add_(eps), 1.0), seen

    # -- the step --------------------------------------------------------------------------
    def replica_step(self, gi: int, p: torch.Tensor, st: dict[str, Any], group: dict) -> None:
        """Update group ``gi``'s momentum (and variance) grids; the weights are replayed
        in :meth:`gather_slots`. ``st["step"]`` has been incremented."""
        beta1, beta2 = group["betas"]
        grids = self._full_grids(gi, p, st, st["step"] - 1)
        m, v = grids["m"], grids["v"]
        rank = self.context.comm.rank  # type: ignore[attr-defined]
        frozen = self.frozen  # type: ignore[attr-defined]
        if not frozen and st["step"] % st["var_interval"] == 0:  # fp32-averaged slots
            comm = self.context.comm  # type: ignore[attr-defined]
            g = torch.empty_like(m)
            comm.all_gather(
                g.view(-1), p.grad.reshape(-1), f"all_gather(averaged gradients of group {gi})"
            ).wait()
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            m.mul_(beta1).add_(g, alpha=1 - beta1)
        else:
            grid = self._grad.pop(gi)
            if not frozen:  # every rank holds the same average: agree on its scale
                g = grid.mul_(self._agreed_factor(p.grad.reshape(-1), grid[rank], gi))
                m.mul_(beta1).add_(g, alpha=1 - beta1).mul_(v > 0)
            else:  # a local step: this rank's own gradient, its own scale
                own = grid[rank]
                sq = float(torch.dot(own, own))
                factor = float(torch.dot(p.grad.reshape(-1), own)) / sq if sq > 0 else 1.0
                self._local_step(gi, grids, grid, factor, group, st)
        if not frozen:
            self._pending[gi] = (False, group["lr"], group["weight_decay"])
        st["exp_avg"].view(-1).copy_(m[rank])
        st["exp_avg_sq"].view(-1).copy_(v[rank])

    def _local_step(
        self,
        gi: int,
        grids: dict[str, torch.Tensor],
        grid: torch.Tensor,
        factor: float,
        group: dict,
        st: dict[str, Any],
    ) -> None:
        """Fold this rank's gradient into ``A`` and ``B`` and the interval's scalars; at a
        synchronization average ``A`` and ``B`` and set the next interval's momentum."""
        beta1 = group["betas"][0]
        lr, wd = group["lr"], group["weight_decay"]
        k, alpha, p_coef = self.drift.get(gi, (0, 1.0, 0.0))
        k += 1
        keep = 1.0 - lr * wd
        alpha, p_coef = alpha * keep, keep * p_coef + lr * beta1**k
        a_sum, b_sum = grids["A"], grids["B"]
        a_sum.mul_(beta1).add_(grid, alpha=factor)
        b_sum.mul_(keep).add_(a_sum, alpha=lr)
        if st["step"] % st["local_step_interval"] != 0:
            self.drift[gi] = (k, alpha, p_coef)
            self._pending[gi] = (True, alpha, p_coef, b_sum, None)
            return
        # synchronize: the rank-averaged sums, 1-bit compressed (stage 0's all-reduce)
        a_mean = self.average(a_sum.view(-1), f"A.{gi}").view_as(a_sum)  # type: ignore[attr-defined]
        b_mean = self.average(b_sum.view(-1), f"B.{gi}").view_as(b_sum)  # type: ignore[attr-defined]
        seen = grids["v"] > 0
        m_next = grids["m"].mul(beta1**k).add_(a_mean, alpha=1 - beta1).mul_(seen)
        a_sum.zero_()
        b_sum.zero_()
        self.drift[gi] = (0, 1.0, 0.0)
        self._pending[gi] = (True, alpha, p_coef, b_mean, m_next)

    def _drifted(
        self, gi: int, cols: slice, alpha: float, p_coef: float, b_sum: torch.Tensor
    ) -> torch.Tensor:
        """Columns ``cols`` of the weights after this interval's local steps so far:
        ``alpha * x_s - (P * m_s + (1 - beta1) * B) / d`` (zero update where ``v`` is 0)."""
        grids = self.grids[gi]
        beta1 = self.param_groups[gi]["betas"][0]  # type: ignore[attr-defined]
        d, seen = self._denominators(gi, cols)
        drift = grids["m"][:, cols].mul(p_coef).add_(b_sum[:, cols], alpha=1 - beta1)
        return grids["x"][:, cols].mul(alpha).sub_(drift.mul_(seen).div_(d))

    def gather_slots(self, held: torch.Tensor, key: str, group: int, offset: int) -> torch.Tensor:
        """Before the freeze: every slot's update replayed on ``held`` (equal on every
        rank). After it: this rank's own weights from the interval's start and sums
        (:meth:`_drifted`); at a synchronization, everyone's same averaged weights."""
        comm = self.context.comm  # type: ignore[attr-defined]
        cols = slice(offset, offset + held.shape[1])
        grids = self.grids[group]
        pending = self._pending[group]
        if not pending[0]:
            _, lr, wd = pending
            d, _ = self._denominators(group, cols)
            out = replay(held, grids["m"][:, cols], d, lr, wd)
            if self.frozen:  # type: ignore[attr-defined]  # the first interval starts here
                if "x" not in grids:
                    grids["x"] = torch.zeros_like(grids["m"])
                grids["x"][:, cols] = out
        else:
            _, alpha, p_coef, b_sum, m_next = pending
            out = self._drifted(group, cols, alpha, p_coef, b_sum)
            if m_next is not None:  # synchronized: the next interval starts from here
                grids["x"][:, cols] = out
                grids["m"][:, cols] = m_next[:, cols]
        master = self.param_groups[group]["params"][0]  # type: ignore[attr-defined]
        master.view(-1)[cols].copy_(out[comm.rank])
        return out

    def restored_slots(self, key: str, group: int, offset: int, width: int) -> torch.Tensor | None:
        """After a load mid-interval: this rank's own drifted weights, recomputed from the
        saved interval start, sums and scalars (the same bits it held); None otherwise."""
        k, alpha, p_coef = self.drift.get(group, (0, 1.0, 0.0))
        if k == 0 or "x" not in self.grids.get(group, {}):
            return None
        cols = slice(offset, offset + width)
        return self._drifted(group, cols, alpha, p_coef, self.grids[group]["B"])

    # -- checkpoints -----------------------------------------------------------------------
    def replica_state(self) -> dict[str, Any]:
        return {
            "grids": {gi: {k: t.clone() for k, t in g.items()} for gi, g in self.grids.items()},
            "drift": {gi: list(t) for gi, t in self.drift.items()},
        }

    def load_replica_state(self, state: dict[str, Any] | None) -> None:
        saved = None if state is None else state.get("replica")
        self.grids.clear()
        self.drift.clear()
        if saved is None:  # rebuilt from the slots on the next step; the drift is dropped
            return
        self.grids = {
            int(gi): {k: t.clone() for k, t in g.items()} for gi, g in saved["grids"].items()
        }
        self.drift = {
            int(gi): (int(k), float(a), float(pc)) for gi, (k, a, pc) in saved["drift"].items()
        }
