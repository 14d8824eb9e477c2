"""Pruning masks: unstructured (L1 / top-k), row, attention-head, channel and N:M.

Each `prune_*` function registers a `PruneMask` parametrization on a layer's `weight` (and,
for rows, on its `bias`), so every forward multiplies the weight by the mask and training
keeps the pruned entries at zero. Masks are *fixed* (`method="l1"`/`"l2"`: scored once from
the weight magnitudes when the mask is switched on) or *learned* (`method="topk"`: a score
per prunable unit, initialised from the magnitudes, trained through a straight-through top-k).

`redundancy_clean(model)` (in `zquant.clean`) turns the structured masks into smaller layers.

Shapes: a Linear weight is (out, in); a Conv weight (out, in, *kernel). A row is an output
unit (dim 0), a channel an input unit (dim 1), a head `head_dim` consecutive input columns
of an attention output projection.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.nn.utils import parametrize

Kind = Literal["sparse", "row", "head", "channel", "nm"]
Method = Literal["l1", "l2", "topk"]
_METHODS = ("l1", "l2", "topk")


class _TopKSTE(torch.autograd.Function):
    """1 for the `keep` largest scores, else 0; the gradient passes straight through."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, keep: int) -> torch.Tensor:  # type: ignore[override]
        mask = torch.zeros_like(scores)
        mask.view(-1)[scores.flatten().topk(keep).indices] = 1.0
        return mask

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def _keep_count(total: int, dense_ratio: float, what: str) -> int:
    if not 0.0 < dense_ratio <= 1.0:
        raise ValueError(
            f"dense_ratio for {what} must be in (0, 1] (the fraction kept), got {dense_ratio}"
        )
    return max(1, round(total * dense_ratio))


class PruneMask(nn.Module):
    """A weight parametrization `w -> w * mask` of one pruning kind; off until `enable()`.

    `unit_mask()` is the mask over prunable units (whole weight for `sparse`/`nm`, (out,) for
    `row`, (in,) for `channel`, (num_heads,) for `head`); `expand()` broadcasts it to the weight.
    """

    def __init__(
        self,
        kind: Kind,
        weight_shape: torch.Size,
        *,
        dense_ratio: float = 1.0,
        method: Method = "l1",
        num_heads: int = 1,
        num_kv_heads: int | None = None,
        n: int = 2,
        m: int = 4,
    ) -> None:
        super().__init__()
        if method not in _METHODS:
            raise ValueError(f"pruning method {method!r} is not one of {list(_METHODS)}")
        self.kind, self.method = kind, method
        self.weight_shape = tuple(weight_shape)
        self.dense_ratio, self.n, self.m = dense_ratio, n, m
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.enabled = False
        units = self._unit_shape()
        self.register_buffer("mask", torch.ones(units))
        # Learned scores only for top-k; fixed masks need nothing trainable.
        self.scores = nn.Parameter(torch.zeros(units)) if method == "topk" else None
        # Names of layers whose matching dims `redundancy_clean` removes too (set by callers).
        self.related: list[str] = []

    def _unit_shape(self) -> tuple[int, ...]:
        out, inp = self.weight_shape[0], self.weight_shape[1]
        if self.kind in ("sparse", "nm"):
            return self.weight_shape
        if self.kind == "row":
            return (out,)
        if self.kind == "channel":
            return (inp,)
        if self.kind == "head":
            if inp % self.num_heads:
                raise ValueError(
                    f"head pruning: input width {inp} is not divisible by num_heads "
                    f"{self.num_heads}; pass the attention's head count"
                )
            if self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"head pruning: num_heads {self.num_heads} is not a multiple of "
                    f"num_kv_heads {self.num_kv_heads}"
                )
            return (self.num_heads,)
        raise ValueError(f"unknown pruning kind {self.kind!r}; use sparse|row|head|channel|nm")

    # -- scoring -----------------------------------------------------------------------------
    def _magnitude(self, weight: torch.Tensor) -> torch.Tensor:
        """Per-unit importance from the weight: |w| (sparse/nm), row/column/head L1 or L2 norm."""
        w = weight.detach().float()
        p = 2 if self.method == "l2" else 1
        if self.kind in ("sparse", "nm"):
            return w.abs()
        if self.kind == "row":
            return w.flatten(1).norm(p=p, dim=1)
        cols = w.transpose(0, 1).flatten(1).norm(p=p, dim=1)  # (in,)
        if self.kind == "channel":
            return cols
        return cols.view(self.num_heads, -1).norm(p=p, dim=1)  # (num_heads,)

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        """The 0/1 unit mask keeping the best units at `dense_ratio` (top-k: differentiable)."""
        if self.kind == "nm":
            return _nm_mask(scores, self.n, self.m)
        if self.kind == "head" and self.num_kv_heads != self.num_heads:
            # Grouped-query attention: keep the same number of query heads in every KV group,
            # so the cleaned attention still repeats each KV head a whole number of times.
            groups = scores.view(self.num_kv_heads, -1)
            keep = _keep_count(groups.shape[1], self.dense_ratio, "heads per KV group")
            out = torch.zeros_like(groups)
            out.scatter_(1, groups.detach().topk(keep, dim=1).indices, 1.0)
            out = out.flatten()
            return out + (scores - scores.detach()) if scores.requires_grad else out
        keep = _keep_count(scores.numel(), self.dense_ratio, f"{self.kind} pruning")
        return _TopKSTE.apply(scores, keep)

    @torch.no_grad()
    def enable(self, weight: torch.Tensor) -> None:
        """Switch the mask on, scoring units from `weight` (the unmasked original)."""
        magnitude = self._magnitude(weight)
        if self.scores is not None:
            self.scores.copy_(magnitude)
        self.mask.copy_(self._select(magnitude))
        self.enabled = True

    def unit_mask(self) -> torch.Tensor:
        """The current 0/1 mask over units (recomputed from the scores for top-k)."""
        if self.scores is not None and self.enabled:
            mask = self._select(self.scores)
            with torch.no_grad():
                self.mask.copy_(mask.detach())
            return mask
        return self.mask

    def expand(self, mask: torch.Tensor) -> torch.Tensor:
        """Broadcast a unit mask to the weight's shape."""
        extra = (1,) * (len(self.weight_shape) - 2)
        if self.kind in ("sparse", "nm"):
            return mask
        if self.kind == "row":
            return mask.view(-1, 1, *extra)
        if self.kind == "head":
            mask = mask.repeat_interleave(self.weight_shape[1] // self.num_heads)
        return mask.view(1, -1, *extra)

    def kept(self) -> torch.Tensor:
        """Indices of the kept units (rows, channels or heads), ascending."""
        return torch.nonzero(self.mask > 0.5).flatten()

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return weight
        return weight * self.expand(self.unit_mask()).to(weight.dtype)


class BiasRowMask(nn.Module):
    """Masks a bias with its weight's row mask, so a pruned row outputs exactly 0."""

    def __init__(self, rows: PruneMask) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, bias: torch.Tensor) -> torch.Tensor:
        if not self.rows.enabled:
            return bias
        return bias * self.rows.unit_mask().to(bias.dtype)


def _nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the `n` largest of every `m` consecutive entries along the input dim."""
    if not 0 < n <= m:
        raise ValueError(f"N:M pruning needs 0 < n <= m, got n={n}, m={m}")
    rows = scores.reshape(scores.shape[0], -1)
    if rows.shape[1] % m:
        raise ValueError(
            f"N:M pruning: input width {rows.shape[1]} is not divisible by m={m}; "
            "pick a layer whose input size is a multiple of m"
        )
    groups = rows.view(rows.shape[0], -1, m)  # (out, in/m, m)
    out = torch.zeros_like(groups)
    out.scatter_(2, groups.topk(n, dim=2).indices, 1.0)
    return out.view_as(scores)


def _check_layer(module: nn.Module) -> None:
    if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        raise TypeError(
            f"pruning works on nn.Linear / nn.ConvNd, got {type(module).__name__}; "
            "select the projection layers, not their container"
        )


def masks_of(module: nn.Module) -> list[PruneMask]:
    """The `PruneMask`s registered on `module.weight`, in application order."""
    if not parametrize.is_parametrized(module, "weight"):
        return []
    return [p for p in module.parametrizations["weight"] if isinstance(p, PruneMask)]


def mask_of(module: nn.Module, kind: Kind | None = None) -> PruneMask | None:
    """The first `PruneMask` (of `kind`, if given) on `module.weight`, if any."""
    for mask in masks_of(module):
        if kind is None or mask.kind == kind:
            return mask
    return None


def original_weight(module: nn.Module) -> torch.Tensor:
    """`module.weight` before any parametrization."""
    if parametrize.is_parametrized(module, "weight"):
        return module.parametrizations["weight"].original
    return module.weight


def _register(module: nn.Module, mask: PruneMask, enable: bool) -> PruneMask:
    _check_layer(module)
    if mask_of(module, mask.kind) is not None:
        raise ValueError(
            f"{type(module).__name__} {tuple(module.weight.shape)} already has a {mask.kind} "
            "mask; each pruning kind once per layer"
        )
    if enable:
        mask.enable(original_weight(module))
    # unsafe: the mask keeps the shape; skips the extra forward that the safe check runs.
    parametrize.register_parametrization(module, "weight", mask, unsafe=True)
    if mask.kind == "row" and getattr(module, "bias", None) is not None:
        parametrize.register_parametrization(module, "bias", BiasRowMask(mask), unsafe=True)
    return mask


def _prune_by_kind(
    kind: Kind, module: nn.Module, dense_ratio: float, method: Method, enable: bool
) -> PruneMask:
    _check_layer(module)
    mask = PruneMask(kind, module.weight.shape, dense_ratio=dense_ratio, method=method)
    return _register(module, mask, enable)


def prune_sparse(
    module: nn.Module, dense_ratio: float, method: Method = "l1", *, enable: bool = True
) -> PruneMask:
    """Unstructured pruning: keep the `dense_ratio` fraction of weights with the largest |w|."""
    return _prune_by_kind("sparse", module, dense_ratio, method, enable)


def prune_rows(
    module: nn.Module, dense_ratio: float, method: Method = "l1", *, enable: bool = True
) -> PruneMask:
    """Row pruning: keep the `dense_ratio` fraction of output rows (by L1/L2 norm) and their bias."""
    return _prune_by_kind("row", module, dense_ratio, method, enable)


def prune_channels(
    module: nn.Module, dense_ratio: float, method: Method = "l1", *, enable: bool = True
) -> PruneMask:
    """Channel pruning: keep the `dense_ratio` fraction of input channels (weight columns)."""
    return _prune_by_kind("channel", module, dense_ratio, method, enable)


def prune_heads(
    out_proj: nn.Module,
    num_heads: int,
    dense_ratio: float,
    method: Method = "l1",
    *,
    num_kv_heads: int | None = None,
    enable: bool = True,
) -> PruneMask:
    """Head pruning on an attention output projection: mask whole heads of its input columns.

    With grouped-query attention pass `num_kv_heads`; the same number of query heads is kept
    in every KV group.
    """
    _check_layer(out_proj)
    mask = PruneMask(
        "head",
        out_proj.weight.shape,
        dense_ratio=dense_ratio,
        method=method,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )
    return _register(out_proj, mask, enable)


def prune_nm(module: nn.Module, n: int = 2, m: int = 4, *, enable: bool = True) -> PruneMask:
    """N:M semi-structured pruning: the `n` largest |w| of every `m` along the input dim."""
    _check_layer(module)
    return _register(module, PruneMask("nm", module.weight.shape, n=n, m=m), enable)


def sparsity(module: nn.Module) -> float:
    """Fraction of zeros in the effective (masked) weight."""
    w = module.weight
    return float((w == 0).sum()) / w.numel()
