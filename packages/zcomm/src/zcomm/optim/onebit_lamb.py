"""1-bit LAMB (Li et al., 2021; DeepSpeed's ``OnebitLamb``), on any torch.distributed backend.

For ``freeze_step`` steps it is LAMB on gradients the engine averages in full precision:
each parameter's Adam-style update ``m / (sqrt(v) + eps) + weight_decay * p`` is scaled by
its trust ratio ``||p|| / ||update||`` clamped to ``[min_coeff, max_coeff]``, and a running
average of the ratio (``coeff_beta``) is kept. Then ``v`` is frozen and the momentum of
every parameter, each first scaled to a common magnitude (``scaling_coeff``, fixed at the
freeze), is averaged as one flat buffer with the 1-bit compressed all-reduce. The trust
ratio becomes the frozen running ratio times a factor that tracks how far a fresh variance
estimate (from the gradients reconstructed from the momentum) has moved from the frozen
one, clamped to ``[factor_min, factor_max]`` and to ``factor_threshold`` change per step.
All of it follows DeepSpeed's ``lamb.py`` step for step, without its buffer-allocating
first step and with the error buffers checkpointed per rank.

LAMB's ratio needs whole parameters: zcore hands their places in the flat master tensors
(:class:`~zcore.zero.communicating.OptimizerContext`).

**ZeRO stages 1-2** (DeepSpeed refuses every stage). A parameter may be cut across ranks,
so every norm and maximum LAMB takes per parameter is a sum (or max) of the pieces each
rank holds: the pieces' squared sums go into one small vector, all-reduced once per step,
and every rank gets the same trust ratios. After the freeze each rank owns its slot of the
momentum, so, as in 1-bit Adam at stages 1-2, the gradients (not the momentum) go through
the 1-bit compressed reduce-scatter and the owner folds its averaged slot into the momentum
exactly; the fresh variance then sees that average instead of a gradient reconstructed
from compressed momenta. What travels is ``g / (sqrt(v) + eps)`` (the frozen variance,
all-gathered once), multiplied back after: with one sign scale per slot for raw gradients,
LayerNorm gains and embeddings shared it, and LAMB at lr 0.01 diverged on `z train`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zcomm.optim.base import OneBitBase
from zcore.zero.communicating import OptimizerContext


class OneBitLamb(OneBitBase):
    """DeepSpeed's 1-bit LAMB over zcore's flat master tensors (ZeRO stages 0-2)."""

    zero_stages = (0, 1, 2)

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        compressed_weight_gather: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)
        if compressed_weight_gather:
            raise ValueError(
                "optimizer.params.compressed_weight_gather is supported by OneBitAdam and "
                "ZeroOneAdam only: OneBitLamb's per-parameter trust ratios are not part of the "
                "update every rank replays; remove it"
            )
        self.compressed_weight_gather = False
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        self.segments: list[list[tuple[int, int]]] | None = None
        self.lamb_coeffs: list[float] = []
        """The trust ratio each parameter got in the last step (DeepSpeed's ``lamb_coeffs``)."""

    def bind(self, context: OptimizerContext) -> None:
        super().bind(context)
        self.segments = [[(off, n) for _, off, n in group] for group in context.segments]

    def compressing(self) -> bool:
        return self.completed_steps() >= self.freeze_step

    def reduce_gradients(self) -> bool:
        return not self.compressing()

    def _pieces(self, gi: int, flat: torch.Tensor) -> list[tuple[int, int]]:
        """Each parameter's ``(offset, numel)`` in ``flat``; at stages 1-2 every parameter of
        the group, empty ones included, so that index ``j`` names the same one on every rank."""
        if self.segments is None:  # used outside zcore: each tensor is one parameter
            return [(0, flat.numel())]
        return [(off, n) for off, n in self.segments[gi] if n > 0 or self.stage > 0]

    def reduce_scatter_local(self, grid: torch.Tensor, key: str) -> torch.Tensor:
        """Stages 1-2 after the freeze: the compressed reduce-scatter of ``g / (sqrt(v) +
        eps)``, multiplied back after. The variance is frozen, so every slot's denominators
        are all-gathered once (when first needed; again after a load) and each rank can
        precondition its whole grid: one sign scale then fits LayerNorm gains and
        embedding rows alike (the job of stage 0's ``scaling_coeff``)."""
        gi = int(key.rsplit(".", 1)[1])
        if not self.state.get(self.param_groups[gi]["params"][0]) or self.context is None:
            return super().reduce_scatter_local(grid, key)
        return self.preconditioned_scatter(grid, key)

    def _across(self, sq: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``sq`` (per-piece sums or maxima) over every rank's pieces: the identity at stage
        0, where each rank holds whole parameters."""
        if self.stage == 0 or self.context is None or self.context.comm.size == 1:
            return sq
        import torch.distributed as dist

        red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        self.context.comm.all_reduce(sq, f"1-bit LAMB per-parameter {op}", red).wait()
        return sq

    def _init(self, p: torch.Tensor, count: int) -> dict[str, Any]:
        st = self.state[p]
        if not st:
            st.update(step=0, lamb_coeff_freeze=[0.0] * count, last_factor=[1.0] * count)
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
            st["exp_avg_sq_fresh"] = torch.zeros_like(p)
        return st

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self.lamb_coeffs = []
        live = [
            (gi, g, p)
            for gi, g in enumerate(self.param_groups)
            for p in g["params"]
            if p.grad is not None
        ]
        if self.compressing() and self.stage > 0:
            self._sharded_compressed_step(live)
        elif self.compressing():
            self._compressed_step(live)
        else:
            for gi, group, p in live:
                self._warmup_step(gi, group, p)
        return loss

    def _warmup_step(self, gi: int, group: dict[str, Any], p: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        pieces = self._pieces(gi, p)
        st = self._init(p, len(pieces))
        st["step"] += 1
        m, v, g = st["exp_avg"], st["exp_avg_sq"], p.grad
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if st["step"] == self.freeze_step:
            st["exp_avg_sq_fresh"].copy_(v)
        updates = []
        sq = torch.zeros(2 * len(pieces), dtype=torch.float64)
        for j, (off, n) in enumerate(pieces):
            w = p[off : off + n]
            update = m[off : off + n] / (v[off : off + n].sqrt() + group["eps"])
            if group["weight_decay"] > 0:
                update.add_(w, alpha=group["weight_decay"])
            updates.append(update)
            sq[2 * j], sq[2 * j + 1] = (
                float(w.double().square().sum()),
                float(update.double().square().sum()),
            )
        norms = self._across(sq).sqrt().tolist()
        for j, (off, n) in enumerate(pieces):
            w_norm, u_norm = norms[2 * j], norms[2 * j + 1]
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
            if coeff != 1.0:
                st["lamb_coeff_freeze"][j] = (
                    self.coeff_beta * st["lamb_coeff_freeze"][j] + (1 - self.coeff_beta) * coeff
                )
            self.lamb_coeffs.append(coeff)
            p[off : off + n].add_(updates[j], alpha=-group["lr"] * coeff)

    def _compressed_step(self, live: list[tuple[int, dict[str, Any], torch.Tensor]]) -> None:
        states = [self.state[p] for _, _, p in live]
        pieces = [self._pieces(gi, p) for gi, _, p in live]
        if "scaling_coeff" not in states[0]:  # fixed once, at the first compressed step
            scales = [
                [float(st["exp_avg"][o : o + n].norm()) / math.sqrt(n) for o, n in ps]
                for st, ps in zip(states, pieces, strict=True)
            ]
            flat_scales = [s for row in scales for s in row]
            united = sum(flat_scales) / len(flat_scales)
            for st, row in zip(states, scales, strict=True):
                st["scaling_coeff"] = [united / s for s in row]
        last = [st["exp_avg"].clone() for st in states]
        for (_, group, p), st, ps in zip(live, states, pieces, strict=True):
            beta1 = group["betas"][0]
            st["step"] += 1
            m = st["exp_avg"]
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            for (o, n), c in zip(ps, st["scaling_coeff"], strict=True):
                m[o : o + n].mul_(c)
        flat = torch.cat([st["exp_avg"] for st in states])  # every group's momentum: one buffer
        flat = self.average(flat, "exp_avg")
        at = 0
        for st in states:
            n = st["exp_avg"].numel()
            st["exp_avg"].copy_(flat[at : at + n])
            at += n
        for (_, group, p), st, ps, m_last in zip(live, states, pieces, last, strict=True):
            beta1, beta2 = group["betas"]
            m, v, v_fresh = st["exp_avg"], st["exp_avg_sq"], st["exp_avg_sq_fresh"]
            for j, ((o, n), c) in enumerate(zip(ps, st["scaling_coeff"], strict=True)):
                mj, w = m[o : o + n], p[o : o + n]
                mj.div_(c)
                grad_rec = (mj - m_last[o : o + n] * beta1) / (1 - beta1)
                v_fresh[o : o + n].mul_(beta2).addcmul_(grad_rec, grad_rec, value=1 - beta2)
                denom = v[o : o + n].sqrt() + group["eps"]
                prelim = mj / denom
                update = prelim + group["weight_decay"] * w if group["weight_decay"] > 0 else prelim
                u_norm = float(update.norm())
                factor = float((denom / (v_fresh[o : o + n].sqrt() + group["eps"])).max())
                coeff = self._coeff(st, j, factor, float(prelim.norm()), u_norm, group)
                w.add_(update, alpha=-group["lr"] * coeff)

    def _coeff(
        self,
        st: dict[str, Any],
        j: int,
        factor: float,
        prelim_norm: float,
        u_norm: float,
        group: dict[str, Any],
    ) -> float:
        """The compression stage's trust ratio of piece ``j``: the frozen running ratio times
        the variance-drift ``factor``, damped by weight decay's share of the update and
        clamped to ``[factor_min, factor_max]`` and ``factor_threshold`` per step."""
        if group["weight_decay"] > 0:
            ratio = min(1.0, prelim_norm / u_norm) if u_norm else 1.0
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        prev = st["last_factor"][j]
        factor = min(
            max(factor, prev * (1.0 - self.factor_threshold)), prev * (1.0 + self.factor_threshold)
        )
        st["last_factor"][j] = factor
        coeff = st["lamb_coeff_freeze"][j] * factor
        self.lamb_coeffs.append(coeff)
        return coeff

    def _sharded_compressed_step(
        self, live: list[tuple[int, dict[str, Any], torch.Tensor]]
    ) -> None:
        """Stages 1-2 after the freeze: each ``p.grad`` is this slot's 1-bit averaged
        gradient; per-parameter norms and maxima are taken across the ranks' pieces."""
        work, sums, maxes = [], [], []
        for gi, group, p in live:
            beta1, beta2 = group["betas"]
            st, pieces = self.state[p], self._pieces(gi, p)
            st["step"] += 1
            m, v, v_fresh, g = st["exp_avg"], st["exp_avg_sq"], st["exp_avg_sq_fresh"], p.grad
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v_fresh.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = v.sqrt() + group["eps"]
            prelim = m / denom
            update = prelim + group["weight_decay"] * p if group["weight_decay"] > 0 else prelim
            drift = denom / (v_fresh.sqrt() + group["eps"])
            for o, n in pieces:
                sums += [
                    float(prelim[o : o + n].double().square().sum()),
                    float(update[o : o + n].double().square().sum()),
                ]
                maxes.append(float(drift[o : o + n].max()) if n else 0.0)
            work.append((group, p, st, pieces, update))
        norms = self._across(torch.tensor(sums, dtype=torch.float64)).sqrt().tolist()
        peaks = self._across(torch.tensor(maxes, dtype=torch.float64), "max").tolist()
        at = 0
        for group, p, st, pieces, update in work:
            for j, (o, n) in enumerate(pieces):
                prelim_norm, u_norm = norms[2 * at], norms[2 * at + 1]
                coeff = self._coeff(st, j, peaks[at], prelim_norm, u_norm, group)
                p[o : o + n].add_(update[o : o + n], alpha=-group["lr"] * coeff)
                at += 1
