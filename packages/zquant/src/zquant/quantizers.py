"""Weight and activation quantizers: the readable torch reference every kernel is tested against.

Weights are ``(out, in)`` matrices (``nn.Linear.weight`` layout). A
:class:`QuantSpec` says how they are quantized; :func:`quantize_weight` returns
a :class:`QuantizedWeight` holding the *packed* codes plus scales (and zero
points) (both defined in :mod:`zquant.spec`), :func:`dequantize_weight` turns it back into float32, and
:func:`fake_quantize` does both in one differentiable step (straight-through
gradient) for quantization-aware training and distillation.

Scales are stored as float32 ``(R, G)``: ``R`` is 1 for per-tensor and ``out``
otherwise, ``G`` is the number of groups along ``in`` (1 unless group-wise). A
group size that does not divide ``in`` pads the last group (the padding is
excluded from every statistic, so it does not change the scales).

Formats (``value = scale * level``):

* ``int`` symmetric: ``level = q`` in ``[-(2**(b-1)-1), 2**(b-1)-1]`` (the
  restricted range, so INT8 products never see -128), ``scale = absmax / qmax``.
  Stored as signed ints (8/16-bit containers) or, for ``b <= 4``, as unsigned
  offset codes ``q + 2**(b-1)`` packed two (``b`` 3-4) or four (``b`` 2) per byte.
* ``int`` asymmetric: ``level = code - zero``, ``code`` in ``[0, 2**b-1]``,
  ``scale = (max-min) / (2**b-1)``, ``zero = round(-min/scale)`` (float32 holding
  integers, kept in ``zero``); a constant group spans zero to its value, so the value
  is exact.
* ``fp6``: e3m2 codes (see :mod:`zquant.packing`), ``scale = absmax / 28``, stored
  as the 4+2 bit split (``data`` the 4-bit plane, ``data2`` the 2-bit plane).
* ``binary`` (XNOR-Net / BinaryBERT): ``level = sign(w)`` (0 counts as +),
  ``scale = mean|w|`` per row/group; bit 1 means +1, eight per byte.
* ``ternary`` (TWN): threshold ``0.7 * mean|w|``, ``level`` in ``{-1, 0, +1}``,
  ``scale = mean|w|`` over the weights above the threshold; codes 0 / 1 (+1) /
  2 (-1), four per byte.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zquant.activations import (
    StraightThrough,
    fake_quantize_activation,
    minmax_scale,
    quantize_activation_tokenwise,
)
from zquant.packing import (
    FP6_MAX,
    fp6_decode,
    fp6_encode,
    pack_bits,
    pack_fp6,
    unpack_bits,
    unpack_fp6,
)
from zquant.spec import QuantizedWeight, QuantSpec, container_bits, group_geometry

__all__ = [
    "QuantSpec",
    "QuantizedWeight",
    "dequantize_weight",
    "encode",
    "expand_groups",
    "fake_quantize",
    "fake_quantize_activation",
    "group_geometry",
    "levels",
    "pack_weight",
    "quantize_activation_tokenwise",
    "quantize_weight",
    "unpack_codes",
    "weight_scales",
]


def _grouped(w: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    """``w (out, in)`` to ``(out, G, g)`` (zero-padded), a validity mask ``(1, G, g)`` and
    the dims to reduce for one scale."""
    out, in_ = w.shape
    g, n_groups = group_geometry(spec, in_)
    pad = n_groups * g - in_
    wp = torch.nn.functional.pad(w, (0, pad)) if pad else w
    mask = torch.ones(n_groups * g, dtype=torch.bool, device=w.device)
    if pad:
        mask[in_:] = False
    dims = (0, 2) if spec.granularity == "tensor" else (2,)
    return wp.reshape(out, n_groups, g), mask.reshape(1, n_groups, g), dims


def _masked_mean(x: Tensor, mask: Tensor, dims: tuple[int, ...]) -> Tensor:
    if bool(mask.all()):  # no padded group: a plain mean, several times cheaper
        return x.mean(dim=dims, keepdim=True)
    count = mask.expand_as(x).sum(dim=dims, keepdim=True).clamp(min=1)
    return (x * mask).sum(dim=dims, keepdim=True) / count


def _twn(wg: Tensor, mask: Tensor, dims: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """TWN's kept weights (above 0.7 times the group's mean magnitude) and their scale
    (the mean magnitude of the kept weights), keepdim."""
    mag = wg.abs()
    keep = mag > 0.7 * _masked_mean(mag, mask, dims)
    if not bool(mask.all()):
        keep &= mask
    return keep, _masked_mean(mag, keep, dims)


def _ungroup(codes: Tensor, in_: int) -> Tensor:
    return codes.reshape(codes.shape[0], -1)[:, :in_]


def _scales(
    wg: Tensor, mask: Tensor, dims: tuple[int, ...], spec: QuantSpec
) -> tuple[Tensor, Tensor | None]:
    """Scale and zero point (``None`` unless asymmetric int) of grouped weights, keepdim."""
    if spec.fmt == "int" and spec.symmetric:
        absmax = wg.abs().amax(dim=dims, keepdim=True)
        return torch.where(
            absmax > 0, absmax / (2 ** (spec.bits - 1) - 1), torch.ones_like(absmax)
        ), None
    if spec.fmt == "int":
        lo = wg.masked_fill(~mask, float("inf")).amin(dim=dims, keepdim=True)
        hi = wg.masked_fill(~mask, float("-inf")).amax(dim=dims, keepdim=True)
        return minmax_scale(lo, hi, spec.bits)
    if spec.fmt == "fp6":
        absmax = wg.abs().amax(dim=dims, keepdim=True)
        return torch.where(absmax > 0, absmax / FP6_MAX, torch.ones_like(absmax)), None
    if spec.fmt == "binary":
        return _masked_mean(wg.abs(), mask, dims), None
    return _twn(wg, mask, dims)[1], None  # ternary


def encode(w: Tensor, scale: Tensor, zero: Tensor | None, spec: QuantSpec) -> Tensor:
    """Codes of ``w`` on a given (broadcastable) scale and zero point: round to nearest on
    the format's grid, saturating. ``int`` and ``fp6`` only (binary and ternary codes are
    not a rounding of ``w / scale``)."""
    if spec.fmt == "int" and spec.symmetric:
        qmax = 2 ** (spec.bits - 1) - 1
        return torch.clamp(torch.round(w / scale), -qmax, qmax)
    if spec.fmt == "int":
        assert zero is not None, "asymmetric int codes need a zero point"
        return torch.clamp(torch.round(w / scale) + zero, 0, 2**spec.bits - 1)
    if spec.fmt == "fp6":
        return fp6_encode(w / scale)
    raise ValueError(
        f"encode: {spec.describe()} codes are not a rounding of w / scale; use quantize_weight"
    )


def _quantize_codes(w: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor, Tensor | None]:
    """Unpacked codes ``(out, in)`` (int32 levels or format codes), scale and zero ``(R, G)``."""
    in_ = w.shape[1]
    wg, mask, dims = _grouped(w.to(torch.float32), spec)
    if spec.fmt == "ternary":  # codes from the kept weights, which also set the scale
        keep, scale = _twn(wg, mask, dims)
        zero = None
        codes = torch.where(keep, torch.where(wg > 0, 1, 2), 0).to(torch.uint8)
    else:
        scale, zero = _scales(wg, mask, dims, spec)
        if spec.fmt == "binary":
            codes = (wg >= 0).to(torch.uint8)
        else:
            codes = encode(wg, scale, zero, spec)
    scale = scale.squeeze(-1)
    return _ungroup(codes, in_), scale, None if zero is None else zero.squeeze(-1)


def weight_scales(w: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor | None]:
    """The scale and zero point ``(R, G)`` :func:`quantize_weight` would give ``w``."""
    wg, mask, dims = _grouped(w.to(torch.float32), spec)
    scale, zero = _scales(wg, mask, dims, spec)
    return scale.squeeze(-1), None if zero is None else zero.squeeze(-1)


def levels(codes: Tensor, spec: QuantSpec, zero: Tensor | None, in_: int) -> Tensor:
    """Codes ``(out, in)`` to float32 levels (to be multiplied by the scale)."""
    if spec.fmt == "fp6":
        return fp6_decode(codes.to(torch.uint8))
    if spec.fmt == "binary":
        return codes.to(torch.float32) * 2 - 1
    if spec.fmt == "ternary":
        c = codes.to(torch.float32)
        return torch.where(c == 2, -1.0, c)
    if zero is not None:
        return codes.to(torch.float32) - expand_groups(zero, spec, codes.shape[0], in_)
    return codes.to(torch.float32)


def expand_groups(t: Tensor, spec: QuantSpec, out: int, in_: int) -> Tensor:
    """Scale or zero ``(R, G)`` broadcast to the full ``(out, in)`` weight."""
    if t.shape[1] == 1:  # per tensor / per channel: a broadcast view, no copy
        return t.expand(out, in_)
    g, _ = group_geometry(spec, in_)
    return t.expand(out, t.shape[1]).repeat_interleave(g, dim=1)[:, :in_]


def _check_weight(w: Tensor, spec: QuantSpec, layer: str) -> None:
    if not isinstance(w, Tensor):
        raise TypeError(f"layer {layer!r}: weight must be a torch.Tensor, got {type(w).__name__}")
    spec.validate(layer=layer, shape=tuple(w.shape))
    if not w.is_floating_point():
        raise ValueError(
            f"layer {layer!r}: weight dtype {w.dtype} is not floating point; pass the float weight"
        )
    if not torch.isfinite((w * 0).sum()):  # NaN iff some element is NaN/inf; one cheap pass
        raise ValueError(
            f"layer {layer!r} (weight shape {tuple(w.shape)}): weight has NaN/inf; fix the checkpoint"
        )


def quantize_weight(w: Tensor, spec: QuantSpec, *, layer: str = "") -> QuantizedWeight:
    """Quantizes and packs ``w (out, in)``; ``layer`` names it in error messages."""
    _check_weight(w, spec, layer)
    with torch.no_grad():
        codes, scale, zero = _quantize_codes(w.detach(), spec)
    return pack_weight(codes, scale, zero, spec)


def pack_weight(
    codes: Tensor, scale: Tensor, zero: Tensor | None, spec: QuantSpec
) -> QuantizedWeight:
    """Packs unpacked codes ``(out, in)`` (as :func:`unpack_codes` returns them) with their
    scale and zero ``(R, G)`` into a :class:`QuantizedWeight`."""
    out, in_ = codes.shape
    with torch.no_grad():
        cbits = container_bits(spec)
        data2 = None
        if spec.fmt == "fp6":
            data, data2 = pack_fp6(codes.to(torch.uint8))
        elif spec.fmt == "int" and cbits <= 4:
            offset = 2 ** (spec.bits - 1) if spec.symmetric else 0
            data = pack_bits((codes + offset).to(torch.uint8), cbits)
        elif spec.fmt == "int":
            dtype = {8: torch.int8, 16: torch.int16}[cbits] if spec.symmetric else None
            if dtype is None:
                dtype = torch.uint8 if cbits == 8 else torch.int32
            data = codes.to(dtype).contiguous()
        else:
            data = pack_bits(codes.to(torch.uint8), cbits)
    return QuantizedWeight(spec, (out, in_), data, scale.contiguous(), zero, data2)


def unpack_codes(qw: QuantizedWeight) -> Tensor:
    """The unpacked codes ``(out, in)`` of ``qw`` as int32 (int: signed levels when
    symmetric, unsigned codes when asymmetric; other formats: their codes)."""
    spec, in_ = qw.spec, qw.shape[1]
    cbits = container_bits(spec)
    if spec.fmt == "fp6":
        if qw.data2 is None:
            raise ValueError("fp6 quantized weight lacks its 2-bit plane data2")
        return unpack_fp6(qw.data, qw.data2, in_).to(torch.int32)
    if cbits <= 4:
        codes = unpack_bits(qw.data, cbits, in_).to(torch.int32)
        if spec.fmt == "int" and spec.symmetric:
            codes = codes - 2 ** (spec.bits - 1)
        return codes
    return qw.data.to(torch.int32)


def dequantize_weight(qw: QuantizedWeight) -> Tensor:
    """float32 ``(out, in)`` reconstruction of ``qw``."""
    out, in_ = qw.shape
    if qw.spec.fmt == "int" and qw.spec.symmetric and container_bits(qw.spec) >= 8:
        return qw.data.to(torch.float32) * expand_groups(qw.scale, qw.spec, out, in_)  # one pass
    values = levels(unpack_codes(qw), qw.spec, qw.zero, in_)
    return values * expand_groups(qw.scale, qw.spec, out, in_)


def fake_quantize(w: Tensor, spec: QuantSpec) -> Tensor:
    """Quantize then dequantize ``w`` (same shape and dtype) with a straight-through gradient.

    Tensors that are not 2-D are treated as ``(shape[0], -1)`` (1-D as one row).
    """
    w2 = w.reshape(1, -1) if w.dim() == 1 else w.reshape(w.shape[0], -1)
    _check_weight(w2, spec, "")
    with torch.no_grad():
        out, in_ = w2.shape
        if spec.fmt in ("binary", "ternary"):
            deq = _sign_values(w2.detach(), spec)
        else:
            codes, scale, zero = _quantize_codes(w2.detach(), spec)
            deq = levels(codes, spec, zero, in_) * expand_groups(scale, spec, out, in_)
    return StraightThrough.apply(w, deq.reshape(w.shape).to(w.dtype))


def _sign_values(w: Tensor, spec: QuantSpec) -> Tensor:
    """Binary/ternary ``w (out, in)`` dequantized without building codes: the values
    :func:`_quantize_codes` and :func:`levels` give, at a fraction of the cost (XTC runs
    this on every weight at every training step)."""
    wg, mask, dims = _grouped(w.to(torch.float32), spec)
    keep, scale = (
        _twn(wg, mask, dims) if spec.fmt == "ternary" else (None, _scales(wg, mask, dims, spec)[0])
    )
    # + 0.0 turns -0.0 into +0.0, which (like 0) takes the + sign
    signed = torch.copysign(scale.expand_as(wg), wg + 0.0)
    return _ungroup(signed if keep is None else signed * keep, w.shape[1])
