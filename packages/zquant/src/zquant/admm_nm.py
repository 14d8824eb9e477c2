"""N:M semi-structured sparsity found by ADMM during fine-tuning (NxMTransformer).

One-shot magnitude N:M (`prune_nm`) keeps the `n` largest |w| of every `m` consecutive input
weights of the *dense* model, then at best fine-tunes under that fixed mask. NxMTransformer
instead treats "W is N:M sparse" as a constraint of the fine-tune and solves it with ADMM,
so the weights move *towards* a sparse pattern the task tolerates before anything is cut:

- W (the Linear weight) minimises `task_loss(W) + rho/2 * ||W - Z + U||^2`;
- every `admm_interval` steps, Z <- proj_NM(W + U) (the N:M projection: keep the `n`
  largest-magnitude entries of each group of `m` along the input dim, zero the rest) and
  the scaled dual U <- U + W - Z accumulates how far W still is from the sparse set;
- rho may grow (`rho_growth`, capped at `rho_max`) so the constraint tightens over time;
  U is rescaled by rho_old / rho_new on each change, as the scaled dual is lambda / rho.

The W-step is Adam on the task loss, with the penalty either added to the loss
(`penalty: "loss"`, the textbook form) or its gradient applied *decoupled*, as AdamW applies
weight decay (`penalty: "decoupled"`): after each Adam step, W <- W - lr * rho * (W - Z + U).
The loss form lets Adam weigh penalty against task per weight, which finds scale-aware masks
when W can move far enough (the synthetic test: 0.32x magnitude's loss); but Adam
divides every gradient by its own running scale, so a penalty added to the loss pulls a
weight by at most ~`lr` per step whatever rho is: with lr 1e-4 and a few dozen steps W never
got near Z, U kept growing, and the projection of W + U churned (measured on MiniLM: the
residual ||W - Z|| / ||W|| rose from 0.35 to 0.51 and the result was worse than magnitude +
fine-tune). Decoupled, `lr * rho` is the fraction of the gap to Z - U closed per step, so
rho keeps its meaning; `lr * rho_max` must stay <= 1 (checked in that mode).

At the end the hard mask is the support of the final projection proj_NM(W + U). It is
registered as an ordinary `PruneMask` of kind `"nm"` (exactly what `prune_nm` registers),
so `redundancy_clean`, `sparsity` and the 2:4 layout take it like any magnitude mask. An
optional short masked fine-tune (`finetune_steps`) then recovers from the cut.

Only the selected layers' weights train (everything else is frozen and the model stays in
eval mode, so no dropout noise), which isolates the effect of the mask and keeps a CPU run
cheap. The baseline with the same budget is `magnitude_nm` + `masked_finetune`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from zquant.compression.config import CompressionConfigError, parse
from zquant.pruning import PruneMask, _nm_mask, original_weight, prune_nm
from zquant.schemes import pattern_matches

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class ADMMConfig:
    """The `admm_nm` block: which layers, which N:M pattern, and the ADMM schedule."""

    n: int = 2
    """Weights kept in every group of `m` (2 for 2:4)."""
    m: int = 4
    """Group size along the input dim; every selected layer's input width must divide by it."""
    modules: list[str] = field(default_factory=lambda: ["*"])
    """Glob / `re:` patterns (as in `zquant.schemes`) of the `nn.Linear` layers to sparsify."""
    steps: int = 40
    """Optimizer steps of the ADMM phase (dense W trained with the penalty)."""
    admm_interval: int = 5
    """Steps between Z/U updates."""
    rho: float = 100.0
    """Initial penalty weight; `lr * rho` is the fraction of the gap to Z - U closed per step."""
    rho_growth: float = 1.0
    """Factor applied to rho at each Z/U update (1 keeps it fixed)."""
    rho_max: float = 2000.0
    """Upper bound of rho (`lr * rho_max` must be <= 1)."""
    lr: float = 1e-4
    """Adam learning rate of both phases."""
    finetune_steps: int = 0
    """Masked fine-tune steps after the hard cut (0: none)."""
    penalty: Literal["decoupled", "loss"] = "decoupled"
    """How the W-step applies rho/2 ||W - Z + U||^2: a decoupled pull after each Adam step,
    or added to the loss (see the module docstring for when each fits)."""

    def __post_init__(self) -> None:
        self.validate("admm_nm")

    def validate(self, where: str) -> None:
        """Raise `CompressionConfigError` naming the first bad key, its value and the fix."""
        if not 0 < self.n <= self.m:
            raise CompressionConfigError(
                f"{where}.n: N:M needs 0 < n <= m, got n={self.n}, m={self.m}; "
                "n is how many weights of every m are kept (2:4 is n=2, m=4)"
            )
        if not self.modules:
            raise CompressionConfigError(f"{where}.modules: empty; name at least one pattern")
        for key, value, low in (
            ("steps", self.steps, 1),
            ("admm_interval", self.admm_interval, 1),
            ("finetune_steps", self.finetune_steps, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise CompressionConfigError(
                    f"{where}.{key}: must be an integer >= {low}, got {value!r}"
                )
        for key, value in (("rho", self.rho), ("rho_max", self.rho_max), ("lr", self.lr)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise CompressionConfigError(
                    f"{where}.{key}: must be a positive number, got {value!r}"
                )
        if self.rho_growth < 1.0:
            raise CompressionConfigError(
                f"{where}.rho_growth: {self.rho_growth} < 1; rho may only stay or grow"
            )
        if self.penalty not in ("decoupled", "loss"):
            raise CompressionConfigError(
                f"{where}.penalty: {self.penalty!r} is not one of ['decoupled', 'loss']"
            )
        if self.penalty == "decoupled" and self.lr * self.rho_max > 1.0:
            raise CompressionConfigError(
                f"{where}.rho_max: lr {self.lr} x rho_max {self.rho_max} = "
                f"{self.lr * self.rho_max:g} > 1 would overshoot Z - U each step; lower rho_max"
            )
        if self.rho_max < self.rho:
            raise CompressionConfigError(
                f"{where}.rho_max: {self.rho_max} is below rho {self.rho}; raise rho_max"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "admm_nm") -> ADMMConfig:
        """Parse a JSON object; unknown keys and wrong types fail naming the key."""
        return parse(cls, data, where)


def nm_project(weight: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Euclidean projection onto the N:M set: `weight` with all but the `n` largest |w| of
    every `m` consecutive input entries set to 0 (the same selection as `prune_nm`)."""
    return weight * _nm_mask(weight.detach().abs(), n, m).to(weight.dtype)


def select_linears(model: nn.Module, patterns: Sequence[str], m: int) -> dict[str, nn.Linear]:
    """The `nn.Linear` layers whose qualified names match any of `patterns`, in model order.

    A pattern matching no Linear, or a layer whose input width is not a multiple of `m`,
    fails naming `admm_nm.modules`.
    """
    linears = {n: mod for n, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    chosen: dict[str, nn.Linear] = {}
    for pattern in patterns:
        hits = [name for name in linears if pattern_matches(pattern, name)]
        if not hits:
            raise CompressionConfigError(
                f"admm_nm.modules: pattern {pattern!r} matches no nn.Linear; "
                f"layer names look like {list(linears)[:3]}"
            )
        chosen.update((name, linears[name]) for name in hits)
    for name, layer in chosen.items():
        if layer.in_features % m:
            raise CompressionConfigError(
                f"admm_nm.modules: {name} has input width {layer.in_features}, not a multiple "
                f"of m={m}; exclude it or pick another m"
            )
    return {name: chosen[name] for name in linears if name in chosen}


class ADMMState:
    """Z (the N:M projection) and the scaled dual U of each layer, and the current rho."""

    def __init__(self, layers: dict[str, nn.Linear], config: ADMMConfig) -> None:
        self.layers, self.config, self.rho = layers, config, config.rho
        with torch.no_grad():
            self.z = {
                k: nm_project(original_weight(v), config.n, config.m) for k, v in layers.items()
            }
            self.u = {k: torch.zeros_like(z) for k, z in self.z.items()}

    def penalty(self) -> torch.Tensor:
        """rho/2 * sum over layers of ||W - Z + U||^2 (differentiable in W)."""
        total = sum(
            (original_weight(layer) - self.z[k] + self.u[k]).pow(2).sum()
            for k, layer in self.layers.items()
        )
        return 0.5 * self.rho * total  # type: ignore[return-value]

    @torch.no_grad()
    def pull(self, lr: float) -> None:
        """The penalty's gradient step, decoupled: W <- W - lr * rho * (W - Z + U)."""
        for k, layer in self.layers.items():
            w = original_weight(layer)
            w.sub_(lr * self.rho * (w - self.z[k] + self.u[k]))

    @torch.no_grad()
    def update(self) -> None:
        """Z <- proj(W + U); U <- U + W - Z; then rho grows and U is rescaled to match."""
        for k, layer in self.layers.items():
            w = original_weight(layer)
            self.z[k] = nm_project(w + self.u[k], self.config.n, self.config.m)
            self.u[k] += w - self.z[k]
        new_rho = min(self.rho * self.config.rho_growth, self.config.rho_max)
        for u in self.u.values():
            u.mul_(self.rho / new_rho)
        self.rho = new_rho

    @torch.no_grad()
    def residual(self) -> float:
        """||W - Z|| / ||W|| over all layers: how far W still is from its N:M projection."""
        num = sum(
            float((original_weight(v) - self.z[k]).pow(2).sum()) for k, v in self.layers.items()
        )
        den = sum(float(original_weight(v).pow(2).sum()) for v in self.layers.values())
        return math.sqrt(num / max(den, 1e-30))

    @torch.no_grad()
    def final_masks(self) -> dict[str, torch.Tensor]:
        """0/1 masks of the final projection proj(W + U), one per layer."""
        n, m = self.config.n, self.config.m
        return {
            k: _nm_mask((original_weight(v) + self.u[k]).abs(), n, m)
            for k, v in self.layers.items()
        }


def apply_nm_masks(
    layers: dict[str, nn.Linear], masks: dict[str, torch.Tensor], n: int, m: int
) -> dict[str, PruneMask]:
    """Register each 0/1 `masks[name]` as the layer's `"nm"` `PruneMask` (as `prune_nm` does)."""
    out = {}
    for name, layer in layers.items():
        pm = prune_nm(layer, n, m, enable=False)
        pm.mask.copy_(masks[name])
        pm.enabled = True
        out[name] = pm
    return out


def magnitude_nm(model: nn.Module, config: ADMMConfig) -> dict[str, PruneMask]:
    """The baseline: one-shot magnitude N:M (`prune_nm`) on the layers `config` selects."""
    layers = select_linears(model, config.modules, config.m)
    return {name: prune_nm(layer, config.n, config.m) for name, layer in layers.items()}


def _train(
    model: nn.Module,
    params: list[torch.Tensor],
    loss_fn: LossFn,
    batches: Sequence[Any],
    steps: int,
    lr: float,
    after_step: Callable[[int], None] | None = None,
    extra_loss: Callable[[], torch.Tensor] | None = None,
) -> list[float]:
    """Adam on `params` only (all else frozen, eval mode); the task loss of each step."""
    if not batches:
        raise ValueError("batches is empty; pass at least one training batch")
    flags = {p: p.requires_grad for p in model.parameters()}
    model.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    was_training = model.training
    model.eval()
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    try:
        for step in range(steps):
            loss = loss_fn(model, batches[step % len(batches)])
            total = loss if extra_loss is None else loss + extra_loss()
            opt.zero_grad(set_to_none=True)
            total.backward()
            opt.step()
            if after_step is not None:
                after_step(step)
            losses.append(float(loss.detach()))
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
        model.train(was_training)
    return losses


def masked_finetune(
    model: nn.Module,
    masks: dict[str, PruneMask],
    loss_fn: LossFn,
    batches: Sequence[Any],
    steps: int,
    lr: float,
) -> list[float]:
    """Fine-tune the masked layers' weights under their fixed masks for `steps` steps.

    `masks` maps layer names (as in `model.named_modules()`) to their `PruneMask`s, as
    `magnitude_nm` and `admm_nm_prune` return them.
    """
    if steps == 0:
        return []
    modules = dict(model.named_modules())
    params = [original_weight(modules[name]) for name in masks]
    return _train(model, params, loss_fn, batches, steps, lr)


@dataclass
class ADMMResult:
    """What `admm_nm_prune` did: the registered masks and the loss / residual history."""

    masks: dict[str, PruneMask]
    admm_losses: list[float]
    finetune_losses: list[float]
    residuals: list[float]
    """||W - Z|| / ||W|| after each Z/U update (falls as W approaches the N:M set)."""
    rhos: list[float]


def admm_nm_prune(
    model: nn.Module, loss_fn: LossFn, batches: Sequence[Any], config: ADMMConfig
) -> ADMMResult:
    """ADMM fine-tune towards N:M, then the hard cut and the optional masked fine-tune.

    `loss_fn(model, batch)` is the task loss (e.g. distillation from the dense model);
    `batches[step % len(batches)]` feeds step `step`. Returns the masks registered on the
    selected layers (kind `"nm"`, n and m from `config`), ready for `redundancy_clean`.
    """
    layers = select_linears(model, config.modules, config.m)
    state = ADMMState(layers, config)
    residuals: list[float] = []
    rhos: list[float] = []

    decoupled = config.penalty == "decoupled"

    def admm_step(step: int) -> None:
        if decoupled:
            state.pull(config.lr)
        if (step + 1) % config.admm_interval == 0 and step + 1 < config.steps:
            state.update()
            residuals.append(state.residual())
            rhos.append(state.rho)

    params = [original_weight(layer) for layer in layers.values()]
    admm_losses = _train(
        model,
        params,
        loss_fn,
        batches,
        config.steps,
        config.lr,
        admm_step,
        None if decoupled else state.penalty,
    )
    state.update()
    residuals.append(state.residual())
    masks = apply_nm_masks(layers, state.final_masks(), config.n, config.m)
    ft = masked_finetune(model, masks, loss_fn, batches, config.finetune_steps, config.lr)
    return ADMMResult(masks, admm_losses, ft, residuals, rhos)
