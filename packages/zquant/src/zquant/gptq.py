"""GPTQ: calibrated rounding that spends each weight's rounding error on the weights not yet
rounded (Frantar et al., 2022), for every ``int`` and ``fp6`` recipe.

Round-to-nearest (`zquant.ptq.quantize`) rounds every weight on its own, so a layer's output
error is the sum of independent errors. GPTQ rounds the columns of ``W (out, in)`` one at a
time and, after each, moves the not-yet-rounded columns to cancel that column's error on the
layer's real inputs ``X``: with ``H = X^T X`` (the Hessian of ``||X W^T - X Q^T||^2``) and
``U`` the upper Cholesky factor of ``H^-1``,

    e = (w_j - q_j) / U[j, j];   W[:, j+1:] -= e U[j, j+1:]

in blocks of columns (lazy batch updates), optionally in order of decreasing ``diag(H)``
(``act_order``: the columns fed by large activations are rounded first, while many
columns are left to absorb their error). The scales and zero points are fixed first, from
the original weight, exactly as round-to-nearest sets them, so a GPTQ weight packs and
runs through the same `QuantLinear` kernels; only which grid point each weight takes
changes. With ``scale_refits`` the scales are then refit by least squares to the chosen
codes (`refit_scales`; the same objective, so the layer's error can only fall), and
rounded again on them (measured gains: ``benchmarks/results/quant-accuracy.md``).

`quantize_gptq` walks the transformer blocks in order: block k's linears get their ``H``
from the inputs block k receives from the *already quantized* blocks before it (so later
blocks also correct what earlier blocks got wrong), over the non-padding tokens of the
calibration batches. Planned layers outside the block stack are rounded to nearest. Memory
is the calibration activations of one block plus one ``(in, in)`` matrix per linear of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from zquant.lkd import capture_blocks, find_blocks
from zquant.quantizers import (
    QuantizedWeight,
    QuantSpec,
    encode,
    expand_groups,
    group_geometry,
    levels,
    pack_weight,
    weight_scales,
)
from zquant.schemes import LayerPlan, Recipe
from zquant.swap import get_submodule_parent, make_quant_linear, swap_layer

__all__ = ["gptq_weight", "quantize_gptq", "refit_scales"]


def _check_spec(spec: QuantSpec, layer: str) -> None:
    if spec.fmt not in ("int", "fp6"):
        raise ValueError(
            f"layer {layer!r}: GPTQ rounds int and fp6 weights, not {spec.describe()}; "
            "use round-to-nearest (no gptq) or XTC for binary/ternary weights"
        )


@torch.no_grad()
def gptq_weight(
    w: Tensor,
    hessian: Tensor,
    spec: QuantSpec,
    *,
    damp: float = 0.01,
    act_order: bool = True,
    block_size: int = 128,
    scale_refits: int = 0,
    layer: str = "",
) -> QuantizedWeight:
    """``w (out, in)`` quantized per ``spec`` with GPTQ rounding against ``hessian (in, in)``
    (``X^T X`` of the layer's inputs, any positive multiple).

    ``damp`` adds ``damp * mean(diag(H))`` to the diagonal (numerical stability; input
    channels that never fire get the weight's own value rounded to nearest).
    ``scale_refits`` > 0 refits the scales by least squares (`refit_scales`) after the
    rounding, and for each refit after the first rounds again on the refit scales first.
    """
    _check_spec(spec, layer)
    out, in_ = w.shape
    if hessian.shape != (in_, in_):
        raise ValueError(
            f"layer {layer!r} (weight shape {(out, in_)}): the Hessian is "
            f"{tuple(hessian.shape)}, expected ({in_}, {in_}); collect it from this layer's inputs"
        )
    if not damp > 0 or block_size < 1 or scale_refits < 0:
        raise ValueError(
            "GPTQ needs damp > 0, block_size >= 1 and scale_refits >= 0, got "
            f"{damp}, {block_size}, {scale_refits}"
        )
    w = w.detach().to(torch.float32)
    if not torch.isfinite(w).all() or not torch.isfinite(hessian).all():
        raise ValueError(f"layer {layer!r}: weight or Hessian has NaN/inf; check the inputs")
    scale, zero = weight_scales(w, spec)
    h = hessian.to(torch.float64)
    u, perm = _inverse_factor(h, damp, act_order, layer)
    codes = _round_columns(w, u, perm, scale, zero, spec, block_size)
    for k in range(scale_refits):
        if k:
            codes = _round_columns(w, u, perm, scale, zero, spec, block_size)
        scale = refit_scales(w, h, codes, scale, zero, spec)
    return pack_weight(codes.to(torch.int32), scale, zero, spec)


def _inverse_factor(h: Tensor, damp: float, act_order: bool, layer: str) -> tuple[Tensor, Tensor]:
    """The upper Cholesky factor of the damped, permuted ``H^-1`` and the column order."""
    h = h.clone()
    in_ = h.shape[0]
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    perm = (
        torch.argsort(torch.diag(h), descending=True, stable=True)
        if act_order
        else torch.arange(in_)
    )
    h = h[perm][:, perm]
    h.diagonal().add_(damp * torch.diag(h).mean())
    return _inverse_cholesky_upper(h, layer).to(torch.float32), perm


def _round_columns(
    w: Tensor,
    u: Tensor,
    perm: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    spec: QuantSpec,
    block_size: int,
) -> Tensor:
    """GPTQ's column loop: codes ``(out, in)`` of ``w`` on ``scale``/``zero`` (float32)."""
    out, in_ = w.shape
    s_p = expand_groups(scale, spec, out, in_)[:, perm]
    z_p = None if zero is None else expand_groups(zero, spec, out, in_)[:, perm]
    work = w[:, perm].clone()
    codes = torch.empty((out, in_), dtype=torch.float32)
    for i1 in range(0, in_, block_size):
        i2 = min(i1 + block_size, in_)
        blk = work[:, i1:i2].clone()
        errs = torch.empty_like(blk)
        u_blk = u[i1:i2, i1:i2]
        for j in range(i2 - i1):
            col = i1 + j
            s_col = s_p[:, col : col + 1]
            z_col = None if z_p is None else z_p[:, col : col + 1]
            c = encode(blk[:, j : j + 1], s_col, z_col, spec)
            q = levels(c, spec, z_col, 1) * s_col
            codes[:, col] = c[:, 0]
            err = (blk[:, j] - q[:, 0]) / u_blk[j, j]
            blk[:, j:] -= err.unsqueeze(1) * u_blk[j, j:].unsqueeze(0)
            errs[:, j] = err
        work[:, i2:] -= errs @ u[i1:i2, i2:]
    return codes[:, torch.argsort(perm)]


@torch.no_grad()
def refit_scales(
    w: Tensor,
    hessian: Tensor,
    codes: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    spec: QuantSpec,
    *,
    ridge: float = 1e-9,
    rows_per_chunk: int = 128,
) -> Tensor:
    """Least-squares scales ``(R, G)`` for fixed ``codes``: the scales that minimise the
    layer's output error ``sum_o (w_o - q_o)^T H (w_o - q_o)`` with ``q = levels * scale``.

    Round-to-nearest and GPTQ take the scale from the weight's range before rounding; once
    the codes are chosen, each row's scales solve a ``G x G`` linear system (``G`` groups,
    coupled through ``H``), or one system for a per-tensor scale, with ``ridge`` (relative
    to the mean diagonal) pulling toward the old scales. The error on the calibration
    inputs does not grow. A group whose codes are all zero, or a row whose solution is not
    finite and positive, keeps its old scale.
    """
    out, in_ = w.shape
    g, n_groups = group_geometry(spec, in_)
    padded = g * n_groups
    h = hessian.to(torch.float64)
    lv = levels(codes, spec, zero, in_).to(torch.float64)
    wd = w.to(torch.float64)
    if padded != in_:  # the last group is padded with zero weights, as when packing
        lv = torch.nn.functional.pad(lv, (0, padded - in_))
        wd = torch.nn.functional.pad(wd, (0, padded - in_))
        h = torch.nn.functional.pad(h, (0, padded - in_, 0, padded - in_))
    h_groups = h.reshape(padded, n_groups, g)
    a = torch.empty((out, n_groups, n_groups), dtype=torch.float64)
    b = torch.empty((out, n_groups), dtype=torch.float64)
    for r0 in range(0, out, rows_per_chunk):
        lv_r = lv[r0 : r0 + rows_per_chunk]
        r = lv_r.shape[0]
        lg = lv_r.reshape(r, n_groups, g)
        # hl[o, i, k] = sum over j in group k of H[i, j] * lv[o, j]
        hl = torch.einsum("ikb,okb->oik", h_groups, lg).reshape(r, n_groups, g, n_groups)
        a[r0 : r0 + r] = torch.einsum("oga,ogak->ogk", lg, hl)
        b[r0 : r0 + r] = (lv_r * (wd[r0 : r0 + r] @ h)).reshape(r, n_groups, g).sum(-1)
    old = scale.to(torch.float64)
    if scale.shape[0] == 1:  # one scale shared by every row
        a, b = a.sum(0, keepdim=True), b.sum(0, keepdim=True)
    diag = a.diagonal(dim1=1, dim2=2)
    degenerate = diag <= 0
    diag.masked_fill_(degenerate, 1.0)
    b = torch.where(degenerate, old.expand_as(b), b)
    # A little ridge toward the old scales keeps directions the calibration barely sees
    # (outlier channels make H's spectrum very wide) from taking wild values.
    lam = ridge * diag.mean(dim=1, keepdim=True)
    diag.add_(lam)
    b = b + lam * old.expand_as(b)
    new = torch.linalg.solve(a, b.unsqueeze(-1)).squeeze(-1)
    ok = (torch.isfinite(new) & (new > 0)).all(dim=1, keepdim=True)
    return torch.where(ok, new, old).to(torch.float32)


def _inverse_cholesky_upper(h: Tensor, layer: str) -> Tensor:
    """Upper Cholesky factor of ``h^-1`` (float64), with more damping if ``h`` is singular."""
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    extra = 0.0
    for _ in range(6):
        try:
            lower = torch.linalg.cholesky(h + extra * eye)
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
        except torch.linalg.LinAlgError:
            extra = max(extra * 10.0, 1e-6 * float(torch.diag(h).mean()))
    raise ValueError(
        f"layer {layer!r}: the calibration Hessian is not positive definite even with damping; "
        "use more (or longer) calibration sentences or a larger damp"
    )


def _split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor, bool]:
    """The hidden-state input of a block call and whether it came positionally."""
    if args:
        return args[0], True
    return kwargs["hidden_states"], False


def _call(
    block: nn.Module, hidden: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor:
    if args:
        out = block(hidden, *args[1:], **kwargs)
    else:
        out = block(**{**kwargs, "hidden_states": hidden})
    return out[0] if isinstance(out, tuple | list) else out


def _hessians(
    block: nn.Module,
    plans: list[LayerPlan],
    model: nn.Module,
    hidden: list[Tensor],
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
    masks: list[Tensor | None],
) -> dict[str, Tensor]:
    """``X^T X`` of every planned linear of ``block`` over the non-padding calibration tokens.

    Linears fed the same tensor (query/key/value, gate/up) share one product per batch: the
    cache holds the input itself, so its ``id`` cannot be reused while the entry lives."""
    sums: dict[str, Tensor] = {}
    handles = []
    current: list[Tensor | None] = [None]
    seen: dict[int, tuple[Tensor, Tensor]] = {}  # id(input) -> (input, X^T X), one batch
    for plan in plans:
        linear = model.get_submodule(plan.name)

        def hook(_m: nn.Module, inputs: Any, _out: Any, name: str = plan.name) -> None:
            x = inputs[0]
            if id(x) not in seen:
                mask = current[0]
                xs = x
                if mask is not None and x.dim() == 3 and tuple(mask.shape) == tuple(x.shape[:2]):
                    xs = x[mask.bool()]
                xs = xs.reshape(-1, xs.shape[-1]).to(torch.float64)
                seen[id(x)] = (x, xs.T @ xs)
            sums[name] = sums.get(name, 0) + seen[id(x)][1]

        handles.append(linear.register_forward_hook(hook))
    try:
        for h, (args, kwargs), mask in zip(hidden, calls, masks, strict=True):
            current[0] = mask
            seen.clear()
            _call(block, h, args, kwargs)
        seen.clear()
    finally:
        for handle in handles:
            handle.remove()
    return sums


@torch.no_grad()
def quantize_gptq(
    model: nn.Module,
    recipe: Recipe,
    calib: Sequence[dict[str, Any]],
    *,
    damp: float = 0.01,
    act_order: bool = True,
    block_size: int = 128,
    scale_refits: int = 0,
) -> nn.Module:
    """Quantize `model` in place per `recipe` with GPTQ rounding on `calib`; return it.

    `calib` is a list of batches of model inputs (`zquant.lkd.calibration_batches`); their
    `attention_mask` keeps padding out of the Hessians.
    """
    if not calib:
        raise ValueError("GPTQ needs calibration batches; pass calibration_batches(...)")
    plans = recipe.plan(model)
    for plan in plans:
        _check_spec(plan.weight, plan.name)
    prefix = find_blocks(model)
    blocks = model.get_submodule(prefix)
    assert isinstance(blocks, nn.ModuleList)
    was_training = model.training
    model.eval()
    try:
        calls = [
            record.inputs
            for record in capture_blocks(model, blocks, calib, outputs=False, later_hidden=False)
        ]
        masks = [batch.get("attention_mask") for batch in calib]
        by_block: dict[int, list[LayerPlan]] = {}
        outside: list[LayerPlan] = []
        for plan in plans:
            rest = plan.name[len(prefix) + 1 :] if plan.name.startswith(prefix + ".") else ""
            index = rest.split(".", 1)[0]
            if index.isdigit():
                by_block.setdefault(int(index), []).append(plan)
            else:
                outside.append(plan)
        hidden = [_split(args, kwargs)[0] for args, kwargs in calls[0]]
        for k, block in enumerate(blocks):
            block_plans = by_block.get(k, [])
            if block_plans:
                sums = _hessians(block, block_plans, model, hidden, calls[k], masks)
                for plan in block_plans:
                    parent, child = get_submodule_parent(model, plan.name)
                    linear = getattr(parent, child)
                    qw = gptq_weight(
                        linear.weight,
                        sums[plan.name],
                        plan.weight,
                        damp=damp,
                        act_order=act_order,
                        block_size=block_size,
                        scale_refits=scale_refits,
                        layer=plan.name,
                    )
                    setattr(parent, child, make_quant_linear(linear, plan, qweight=qw))
            if k + 1 < len(blocks):
                hidden = [
                    _call(block, h, args, kwargs)
                    for h, (args, kwargs) in zip(hidden, calls[k], strict=True)
                ]
        for plan in outside:
            swap_layer(model, plan)
    finally:
        model.train(was_training)
    return model
