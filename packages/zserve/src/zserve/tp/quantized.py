"""A `z quantize` directory's quantized layers cut over ``tp`` tensor-parallel ranks.

The cut is the fp plan's (:mod:`zserve.tp.plan`), applied to the packed weights
(:class:`zquant.quantizers.QuantizedWeight`) without dequantizing them:

* column-parallel (q/k/v, gate/up, the LM head by vocab rows): the rank's output rows of the
  codes, with their per-row scales and zero points (a per-tensor scale stays whole) and bias
  rows. Every packed layout is row-major, so a row slice is exact and never unpacks.
* row-parallel (o, down) with weight-only formats (FP6, W8, W4 with ``ZSERVE_W4_A8=0``): the
  rank's input columns.
  A group-wise scale covers ``group_size`` consecutive columns, so the columns are cut on
  group boundaries: where the rank's slice does not start or end on one (a group wider than
  the rank's heads, e.g. group 128 over SmolLM2's 64-wide heads), the slice is *padded* out
  to the enclosing groups and the rank's activations get as many zero columns
  (:class:`PaddedInput`): a zero activation adds exactly nothing, so the partial sum is the
  slice's. The MLP's cuts are placed on the down projection's group boundaries
  (:func:`mlp_align`), so only attention may pad. Packed codes (INT4 two per byte, FP6's
  4-bit and 2-bit planes) are cut as bytes when both ends fall on a byte of every plane,
  else unpacked, cut and repacked at load. The bias is added on rank 0 only.
* o and down whose *activations* are quantized (W8A8, W4A8, and W4 itself, whose calls
  round activations to INT8 per 32 columns in the kernel:
  :func:`zserve.model.quantized_bound.a8_applies`): token-wise activation
  quantization takes one scale per token over the whole input row, and the recipes' outlier
  channels (`zquant.nn.OutlierQuantLinear`) are the row's largest; a column cut would
  quantize each rank's slice on its own, other numbers than tp=1's (on SmolLM2 with 4 W8A8
  layers that moved logits as far from tp=1 as tp=1 is from fp32, and greedy text with it).
  So these are cut by *output* rows instead (``hidden`` split evenly): each rank gathers the
  whole input (one all-gather of ``(T, in)``, :class:`GatheredInput`), runs its rows on it,
  exactly tp=1's numbers, and writes them into a zero ``(T, hidden)`` that the layer's usual
  all-reduce completes (adding zeros is exact). One more collective per such layer; the
  same bytes of weight per rank. With the MLP cut on :data:`SWIGLU_ALIGN` columns, such a
  model's logits at tp=N are tp=1's bit for bit (SmolLM2 W8A8 and W4A8, every layer).

Weight-only layers only reorder the partial sums; ``tests/zserve/tp/test_tp_quantized.py``
states the tolerances. Not served at tp>1 (a
:class:`~zserve.model.quantized.QuantizedModelError` naming the layer, the widths and the
fix): a pruned MLP (`redundancy_clean`: its stored width is not config.json's, which the
plan cuts).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from zserve.model.config import LlamaConfig
from zserve.model.quantized import (
    HEAD,
    MANIFEST,
    QuantizedLinears,
    QuantizedModelError,
    is_zquant_dir,
)
from zserve.model.quantized_bound import a8_applies, a8_enabled
from zserve.tp.plan import MLP_ALIGN, RankShard, cut_range, even_ranges, plan

if TYPE_CHECKING:
    from zquant.nn import QuantLinear
    from zquant.quantizers import QuantizedWeight
    from zserve.model.llama import LlamaModel
    from zserve.tp.group import TPGroup

_LAYER = re.compile(r"model\.layers\.\d+\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj")
_DOWN = re.compile(r"model\.layers\.\d+\.mlp\.down_proj")
_PACKED = ("qdata", "qscale", "qzero", "qdata2", "bias", "qoutliers")


SWIGLU_ALIGN = 64
"""MLP columns a rank's cut falls on when the MLP's activations are quantized: torch's
elementwise loops (SwiGLU's ``silu(gate) * up``) run whole pairs of vectors (32 floats at
AVX-512) and leave a row's tail to a scalar loop whose ``exp`` differs in the last bit, so
a rank width that is not a multiple gives other bits than tp=1's whole row, and INT8
activation codes amplify them (SmolLM2 W8A8: greedy text changed)."""


def mlp_align(model_dir: str | Path) -> int:
    """Columns the MLP cuts of a zquant directory fall on: :data:`MLP_ALIGN`, every group
    size of its quantized down projections (their row-parallel cut is then exact, never
    padded), and :data:`SWIGLU_ALIGN` when a down projection's activations are quantized."""
    manifest = json.loads((Path(model_dir) / MANIFEST).read_text(encoding="utf-8"))
    align = MLP_ALIGN
    for name, layer in (manifest.get("layers") or {}).items():
        if not (_DOWN.fullmatch(name) and isinstance(layer, dict)):
            continue
        spec = layer.get("weight") or {}
        if spec.get("granularity") == "group":
            align = math.lcm(align, int(spec["group_size"]))
        w4a8 = spec.get("fmt", "int") == "int" and spec.get("bits") in (3, 4) and a8_enabled()
        if layer.get("act_bits") or w4a8:
            align = math.lcm(align, SWIGLU_ALIGN)
    return align


def plan_dir(model_dir: str | Path, tp: int) -> list[RankShard]:
    """Every rank's shard of the model in ``model_dir`` (a zquant directory's MLP cut on
    its down projections' groups)."""
    align = mlp_align(model_dir) if is_zquant_dir(model_dir) else MLP_ALIGN
    return plan(LlamaConfig.from_dir(model_dir), tp, mlp_align=align)


def _per_byte(spec: Any) -> tuple[int, ...]:
    """Codes per byte of each stored plane of ``spec``'s packed codes."""
    from zquant.spec import container_bits

    if spec.fmt == "fp6":
        return (2, 4)  # the 4-bit plane and the 2-bit plane
    bits = container_bits(spec)
    return (max(1, 8 // bits),)


def cut_rows(qw: QuantizedWeight, a: int, b: int) -> QuantizedWeight:
    """Output rows ``a:b`` of ``qw`` (own storage: the whole weight can be freed)."""
    from zquant.quantizers import QuantizedWeight

    per_row = qw.scale.shape[0] != 1 or qw.shape[0] == 1

    def rows(t: torch.Tensor | None, always: bool = True) -> torch.Tensor | None:
        if t is None:
            return None
        return t[a:b].clone() if always or per_row else t.clone()

    data = rows(qw.data)
    scale = rows(qw.scale, always=False)
    assert data is not None and scale is not None
    return QuantizedWeight(
        qw.spec, (b - a, qw.shape[1]), data, scale, rows(qw.zero, False), rows(qw.data2)
    )


def padded_range(qw: QuantizedWeight, a: int, b: int) -> tuple[int, int]:
    """Input columns ``a:b`` widened to the enclosing scale groups of ``qw``."""
    from zquant.quantizers import group_geometry

    if qw.spec.granularity != "group":
        return a, b
    g, _ = group_geometry(qw.spec, qw.shape[1])
    return a // g * g, min(-(-b // g) * g, qw.shape[1])


def cut_cols(qw: QuantizedWeight, a: int, b: int) -> QuantizedWeight:
    """Input columns ``a:b`` of ``qw``, which start and end on scale-group boundaries
    (:func:`padded_range`): byte slices of the packed planes where both ends fall on a
    byte of each, else the codes unpacked, cut and repacked."""
    from zquant.quantizers import (
        QuantizedWeight,
        group_geometry,
        pack_weight,
        unpack_codes,
    )

    spec, in_ = qw.spec, qw.shape[1]
    if (a, b) != padded_range(qw, a, b):
        raise ValueError(f"columns {a}:{b} of a {spec.describe()} weight cut a scale group")
    scale, zero = qw.scale, qw.zero
    if spec.granularity == "group":
        g, _ = group_geometry(spec, in_)
        scale = scale[:, a // g : -(-b // g)].contiguous()
        zero = None if zero is None else zero[:, a // g : -(-b // g)].contiguous()
    planes = _per_byte(spec)  # codes per byte of data (and of FP6's data2)
    if all(a % n == 0 and (b % n == 0 or b == in_) for n in planes):
        n, n2 = planes[0], planes[-1]
        data = qw.data[:, a // n : -(-b // n)].contiguous()
        data2 = None if qw.data2 is None else qw.data2[:, a // n2 : -(-b // n2)].contiguous()
        return QuantizedWeight(spec, (qw.shape[0], b - a), data, scale, zero, data2)
    codes = unpack_codes(qw)[:, a:b]
    return pack_weight(codes, scale, zero, spec)


@dataclass
class PaddedInput:
    """A row-parallel projection over a rank's columns padded out to whole scale groups:
    ``x (T, cols)`` gets ``front`` and ``back`` zero columns first."""

    inner: Callable[[torch.Tensor], torch.Tensor]
    front: int
    back: int

    @property
    def out_features(self) -> int:
        return int(self.inner.out_features)  # type: ignore[attr-defined]

    @property
    def max_rows(self) -> int:
        """The inner kernel's row limit (the step's threading rule reads it)."""
        return int(getattr(self.inner, "max_rows", 0))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(F.pad(x, (self.front, self.back)))

    def kernel_call(self) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
        """The decode program's call (:func:`zserve.model.native_decode.kernel_call`): the
        inner kernel on the padded rows; None when the inner layer is not one kernel."""
        inner = getattr(self.inner, "kernel_call", None)
        if inner is None:
            return None
        kernel, args, kwargs = inner()

        def call(x: Any, *args_: Any, **kw: Any) -> None:
            *weights, out = args_
            padded = F.pad(torch.from_numpy(x), (self.front, self.back))
            kernel(padded.numpy(), *weights, out, **kw)

        return call, args, kwargs


@dataclass
class GatheredInput:
    """A projection cut by output rows ``rows`` of ``hidden``: ``x (T, cols)``, the rank's
    columns of its input, is all-gathered into the whole input ``(T, sum(widths))`` and the
    rank's rows written into a zero ``(T, hidden)`` that the all-reduce after the layer
    completes. ``gather`` is set when the group is up (:func:`connect`)."""

    inner: Callable[[torch.Tensor], torch.Tensor]
    widths: list[int]
    """Every rank's input columns, in rank order."""
    rows: tuple[int, int]
    hidden: int
    gather: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None

    @property
    def out_features(self) -> int:
        return self.hidden

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather is None:
            raise RuntimeError("a row-cut quantized projection runs before its group is up")
        part = self.inner(self.gather(x, self.widths))  # (T, b - a)
        y = torch.zeros(x.shape[0], self.hidden, dtype=part.dtype)
        y[:, self.rows[0] : self.rows[1]] = part
        return y

    @property
    def max_rows(self) -> int:
        """The inner kernel's row limit (the step's routing and threading rule)."""
        return int(getattr(self.inner, "max_rows", 0))

    def kernel_call(self) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
        """The decode program's call: gather, the inner kernel on the rank's rows, written
        into the zeroed output; None when the inner layer is not one kernel."""
        inner = getattr(self.inner, "kernel_call", None)
        if inner is None:
            return None
        kernel, args, kwargs = inner()
        a, b = self.rows

        def call(x: Any, *args_: Any, **kw: Any) -> None:
            *weights, out = args_
            assert self.gather is not None
            whole = self.gather(torch.from_numpy(x), self.widths)
            part = torch.empty(whole.shape[0], b - a, dtype=whole.dtype)
            kernel(whole.numpy(), *weights, part.numpy(), **kw)
            y = torch.from_numpy(out)
            y.zero_()
            y[:, a:b] = part

        return call, args, kwargs


def connect(model: LlamaModel, group: TPGroup) -> None:
    """Give ``model``'s row-cut quantized projections the group's all-gather."""
    for layer in getattr(model.quantization, "gathered", {}).values():
        layer.gather = group.all_gather_columns


@dataclass
class ShardedQuantizedLinears(QuantizedLinears):
    """:class:`QuantizedLinears` answering with rank ``shard.rank``'s cut of each layer."""

    shard: RankShard | None = None
    full: LlamaConfig | None = None
    """The whole model's config (the directory's shapes)."""
    pads: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Row-parallel layers padded to whole groups: name -> (front, back) zero columns."""
    gathered: dict[str, GatheredInput] = field(default_factory=dict)
    """o/down with quantized activations, cut by output rows over the gathered input."""
    _rows: dict[str, tuple[list[int], tuple[int, int]]] = field(default_factory=dict)

    @classmethod
    def cut(
        cls, whole: QuantizedLinears, shard: RankShard, full: LlamaConfig
    ) -> ShardedQuantizedLinears:
        return cls(whole.model_dir, whole.manifest, whole.state, shard=shard, full=full)

    def out_features(self, prefix: str, default: int) -> int:
        """``default`` (the rank's MLP width); a pruned MLP is refused."""
        assert self.full is not None and self.shard is not None
        stored = super().out_features(prefix, self.full.intermediate_size)
        if stored != self.full.intermediate_size:
            raise QuantizedModelError(
                f"layer {prefix!r} of `{self.model_dir}` is pruned to {stored} rows "
                f"(config.json: intermediate_size {self.full.intermediate_size}); "
                f"tensor-parallel serving cuts config.json's width over tp {self.shard.tp}: "
                "serve this directory with --tp 1"
            )
        return default

    def linear(
        self, prefixes: list[str], rows: list[int], cols: int, bias: bool, plain: Any
    ) -> Any:
        out = super().linear(prefixes, rows, cols, bias, plain)
        name = prefixes[0]
        if len(prefixes) == 1 and name in self._rows:
            widths, cut = self._rows[name]
            self.gathered[name] = GatheredInput(out, widths, cut, rows[0])
            return self.gathered[name]
        pad = self.pads.get(name) if len(prefixes) == 1 else None
        return out if pad is None else PaddedInput(out, *pad)

    def _layer(self, name: str, rows: int, cols: int) -> QuantLinear:
        """The rank's cut of quantized layer ``name``, which the rank's model sees as
        ``(rows, cols)`` (plus a padded layer's zero columns)."""
        s, c = self.shard, self.full
        assert s is not None and c is not None
        h = c.hidden_size
        m = _LAYER.fullmatch(name)
        if name == HEAD:  # the rank's vocab rows (the model sees the whole vocabulary)
            axis, full_shape, (a, b) = "rows", (c.vocab_size, h), s.vocab
            rows = b - a
        elif m is not None:
            axis, width, (a, b) = cut_range(m.group(1), s, c)
            full_shape = (width, h) if axis == "rows" else (h, width)
        else:
            return super()._layer(name, rows, cols)
        whole = super()._layer(name, *full_shape)
        qw = whole.quantized_weight()
        layer_bias = whole.bias
        quantized_acts = whole.act_bits is not None or a8_applies(whole)
        if axis == "cols" and quantized_acts:  # by output rows, input gathered
            assert m is not None
            ranges = [cut_range(m.group(1), r, c)[2] for r in plan_dir(self.model_dir, s.tp)]
            axis, (a, b) = "rows", even_ranges(h, s.tp)[s.rank]
            self._rows[name] = ([y - x for x, y in ranges], (a, b))
            rows, cols = b - a, full_shape[1]
        if axis == "rows":
            part, bias = cut_rows(qw, a, b), None if layer_bias is None else layer_bias[a:b]
        else:
            a0, b0 = padded_range(qw, a, b)
            if (a0, b0) != (a, b):
                self.pads[name] = (a - a0, b0 - b)
            part = cut_cols(qw, a0, b0)
            bias = layer_bias if s.rank == 0 else None  # added once, by the all-reduce
        layer = _rebuild(whole, part, bias)
        for key in _PACKED:  # the whole layer's tensors: this rank keeps only its cut
            self.state.pop(f"{name}.{key}", None)
        front, back = self.pads.get(name, (0, 0))
        if (layer.out_features, layer.in_features - front - back) != (rows, cols):
            raise QuantizedModelError(
                f"tensor-parallel rank {s.rank}: the cut of quantized layer {name!r} is "
                f"{(layer.out_features, layer.in_features - front - back)}, the rank's model "
                f"expects {(rows, cols)}"
            )
        return layer


def _rebuild(whole: QuantLinear, part: QuantizedWeight, bias: torch.Tensor | None) -> QuantLinear:
    """A zquant module like ``whole`` (class, activation bits, outlier channels, native
    backend) over the cut weight ``part``."""
    from zquant.nn import OutlierQuantLinear

    layer = type(whole)(part, bias, whole.act_bits, name=whole.name)
    if isinstance(layer, OutlierQuantLinear) and isinstance(whole, OutlierQuantLinear):
        layer.set_outliers(min(whole.act_outliers, layer.in_features))
    layer.backend = "native"
    return layer
