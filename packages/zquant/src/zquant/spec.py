"""What a quantized weight is: :class:`QuantSpec` (format, bits, scale granularity) and
:class:`QuantizedWeight` (its packed codes, scales and zero points, and their flat state).

The formats and the layout of codes and scales are described in :mod:`zquant.quantizers`,
which makes and reads these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

Format = Literal["int", "fp6", "binary", "ternary"]
Granularity = Literal["tensor", "channel", "group"]

_FMTS: tuple[str, ...] = ("int", "fp6", "binary", "ternary")
_GRANS: tuple[str, ...] = ("tensor", "channel", "group")
_FIXED_BITS = {"fp6": 6, "binary": 1, "ternary": 2}
_INT_BITS = range(2, 17)
_STATE_VERSION = 1


@dataclass(frozen=True)
class QuantSpec:
    """How one weight matrix is quantized."""

    bits: int
    """Bits per weight: 1 (``binary``), 2 (``ternary`` or int2), 2-16 for ``int``
    (packed storage for 2-8 and 16-bit containers above), 6 for ``fp6``."""
    fmt: Format = "int"
    """Number format: ``int``, ``fp6`` (e3m2, bias 3), ``binary`` or ``ternary``."""
    symmetric: bool = True
    """Symmetric (zero maps to zero, no zero point) or asymmetric (min/max with a
    zero point). Only ``int`` supports asymmetric."""
    granularity: Granularity = "channel"
    """One scale per ``tensor``, per output ``channel`` (row), or per ``group`` of
    ``group_size`` consecutive input features within a row."""
    group_size: int | None = None
    """Input features per scale when ``granularity == "group"``; if it does not
    divide ``in_features`` the last group is padded."""

    def validate(self, *, layer: str = "", shape: tuple[int, ...] | None = None) -> None:
        """Raises ``ValueError`` naming the layer, the shape, the bad field and the fix."""
        where = f"layer {layer!r}" if layer else "quantization spec"
        if shape is not None:
            where += f" (weight shape {tuple(shape)})"
        if self.fmt not in _FMTS:
            raise ValueError(f"{where}: fmt={self.fmt!r} is unknown; use one of {list(_FMTS)}")
        if not isinstance(self.bits, int) or isinstance(self.bits, bool):
            raise ValueError(f"{where}: bits={self.bits!r} must be an int")
        if self.fmt in _FIXED_BITS and self.bits != _FIXED_BITS[self.fmt]:
            raise ValueError(
                f"{where}: fmt={self.fmt!r} needs bits={_FIXED_BITS[self.fmt]}, got bits={self.bits}; "
                f"set bits={_FIXED_BITS[self.fmt]} or use fmt='int'"
            )
        if self.fmt == "int" and self.bits not in _INT_BITS:
            hint = " (use fmt='binary' for 1 bit)" if self.bits == 1 else ""
            raise ValueError(
                f"{where}: bits={self.bits} is out of range for fmt='int'; use 2..16{hint}"
            )
        if self.fmt != "int" and not self.symmetric:
            raise ValueError(
                f"{where}: fmt={self.fmt!r} is symmetric only, got symmetric=False; set symmetric=True"
            )
        if self.granularity not in _GRANS:
            raise ValueError(
                f"{where}: granularity={self.granularity!r} is unknown; use one of {list(_GRANS)}"
            )
        if self.granularity == "group":
            if self.group_size is None:
                raise ValueError(
                    f"{where}: granularity='group' needs group_size; set e.g. group_size=128"
                )
            if (
                not isinstance(self.group_size, int)
                or isinstance(self.group_size, bool)
                or self.group_size <= 0
            ):
                raise ValueError(
                    f"{where}: group_size={self.group_size!r} must be a positive int; set e.g. group_size=128"
                )
        elif self.group_size is not None:
            raise ValueError(
                f"{where}: group_size={self.group_size} is only used with granularity='group', "
                f"got granularity={self.granularity!r}; set granularity='group' or group_size=None"
            )
        if shape is not None and (len(shape) != 2 or min(shape) <= 0):
            raise ValueError(
                f"{where}: weights must be a non-empty 2-D (out, in) matrix; reshape or skip this layer"
            )

    def describe(self) -> str:
        """Short human-readable form, e.g. ``int4 sym group128``."""
        name = f"{self.fmt}{self.bits}" if self.fmt == "int" else self.fmt
        gran = f"group{self.group_size}" if self.granularity == "group" else self.granularity
        return f"{name} {'sym' if self.symmetric else 'asym'} {gran}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (for recipe manifests)."""
        return {
            "bits": self.bits,
            "fmt": self.fmt,
            "symmetric": self.symmetric,
            "granularity": self.granularity,
            "group_size": self.group_size,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantSpec:
        """Inverse of :meth:`to_dict`; validates."""
        spec = cls(
            bits=int(d["bits"]),
            fmt=d.get("fmt", "int"),
            symmetric=bool(d.get("symmetric", True)),
            granularity=d.get("granularity", "channel"),
            group_size=None if d.get("group_size") is None else int(d["group_size"]),
        )
        spec.validate()
        return spec


def container_bits(spec: QuantSpec) -> int:
    """Bits per stored code: what :func:`zquant.packing.pack_bits` packs."""
    if spec.fmt == "binary":
        return 1
    if spec.fmt == "ternary" or (spec.fmt == "int" and spec.bits <= 2):
        return 2
    if spec.fmt == "int" and spec.bits <= 4:
        return 4
    if spec.fmt == "fp6":
        return 6
    return 8 if spec.bits <= 8 else 16


def group_geometry(spec: QuantSpec, in_features: int) -> tuple[int, int]:
    """``(group_size, n_groups)`` along the input dimension for ``spec``."""
    g = spec.group_size if spec.granularity == "group" and spec.group_size else in_features
    return g, (in_features + g - 1) // g


@dataclass
class QuantizedWeight:
    """Packed codes plus scales of one ``(out, in)`` weight."""

    spec: QuantSpec
    shape: tuple[int, int]
    """``(out, in)`` of the original weight."""
    data: Tensor
    """Codes, row-major ``(out, ...)``: int8/int16 for int > 4 bits symmetric,
    uint8 otherwise (packed along ``in`` per :mod:`zquant.packing`)."""
    scale: Tensor
    """float32 ``(R, G)``, ``R`` 1 (per-tensor) or ``out``, ``G`` groups."""
    zero: Tensor | None = None
    """float32 ``(R, G)`` zero points (integers) for asymmetric int, else None."""
    data2: Tensor | None = None
    """FP6 only: the 2-bit plane ``(out, ceil(in/4))`` (``data`` is the 4-bit plane)."""

    def nbytes(self) -> int:
        """Stored bytes: codes plus scales and zero points."""
        parts = [self.data, self.scale, self.zero, self.data2]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def to_state(self) -> dict[str, Tensor]:
        """Flat tensors for ``state_dict`` / safetensors; :meth:`from_state` reverses it."""
        spec = self.spec
        meta = torch.tensor(
            [
                _STATE_VERSION,
                spec.bits,
                _FMTS.index(spec.fmt),
                int(spec.symmetric),
                _GRANS.index(spec.granularity),
                spec.group_size or 0,
                self.shape[0],
                self.shape[1],
            ],
            dtype=torch.int64,
        )
        state = {"qmeta": meta, "qdata": self.data, "qscale": self.scale}
        if self.zero is not None:
            state["qzero"] = self.zero
        if self.data2 is not None:
            state["qdata2"] = self.data2
        return state

    @classmethod
    def from_state(cls, state: dict[str, Tensor]) -> QuantizedWeight:
        """Rebuilds a :class:`QuantizedWeight` from :meth:`to_state` output."""
        missing = [k for k in ("qmeta", "qdata", "qscale") if k not in state]
        if missing:
            raise ValueError(
                f"quantized weight state lacks {missing}; save it with QuantizedWeight.to_state()"
            )
        version, bits, fmt, sym, gran, gs, out, inf = (int(v) for v in state["qmeta"].tolist())
        if version != _STATE_VERSION:
            raise ValueError(
                f"quantized weight state version {version} is not {_STATE_VERSION}; re-save it"
            )
        spec = QuantSpec(
            bits=bits,
            fmt=_FMTS[fmt],  # type: ignore[arg-type]
            symmetric=bool(sym),
            granularity=_GRANS[gran],  # type: ignore[arg-type]
            group_size=gs or None,
        )
        spec.validate(shape=(out, inf))
        return cls(
            spec,
            (out, inf),
            state["qdata"],
            state["qscale"],
            state.get("qzero"),
            state.get("qdata2"),
        )
