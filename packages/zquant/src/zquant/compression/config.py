"""DeepSpeed's `compression_training` config, validated at construction.

Accepts the JSON of DeepSpeed's compression library (`deepspeed/compression/constants.py`),
either the whole `ds_config` (its `compression_training` block is read, other keys belong to
the training engine) or the block itself:

```json
{"weight_quantization": {
   "shared_parameters": {"enabled": true, "schedule_offset": 5, "quantize_groups": 1,
                         "quantization_type": "symmetric", "rounding": "nearest", ...},
   "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8,
                                            "quantization_period": 0},
                                "modules": ["attention.self", "intermediate"]}}},
 "sparse_pruning": {"shared_parameters": {"enabled": true, "method": "l1", "schedule_offset": 10},
                    "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}, "modules": ["*"]}}},
 "row_pruning": {...}, "head_pruning": {... "num_heads": 12 ...}, "channel_pruning": {...},
 "activation_quantization": {...}, "layer_reduction": {"enabled": true, "keep_number_layer": 3,
   "module_name_prefix": "encoder.layer", "teacher_layer": [1, 3, 5], "other_module_name": [...]}}
```

Every block is a dataclass whose fields are the accepted keys; an unknown key fails with the
key, where it was, and the valid keys. (Plain dataclasses rather than pydantic: zquant depends
on torch and znative only.)
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin


class CompressionConfigError(ValueError):
    """A `compression_training` config that cannot be used; the message names key and fix."""


def _check_type(value: Any, hint: Any, where: str) -> Any:
    origin = get_origin(hint)
    if origin is Literal:
        if value not in get_args(hint):
            raise CompressionConfigError(f"{where}: {value!r} is not one of {list(get_args(hint))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(hint):
            return None
        inner = [a for a in get_args(hint) if a is not type(None)]
        return _check_type(value, inner[0], where)
    if origin is list:
        if not isinstance(value, list):
            raise CompressionConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = get_args(hint)
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise CompressionConfigError(f"{where}: expected an object, got {value!r}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise CompressionConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise CompressionConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CompressionConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise CompressionConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(hint):
        return parse(hint, value, where)
    return value


def parse(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a JSON object, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise CompressionConfigError(f"{where}: expected an object, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise CompressionConfigError(
            f"{where}: unknown key {unknown[0]!r}; valid keys are {names}{hint}"
        )
    values = {k: _check_type(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    obj = cls(**values)
    check = getattr(obj, "check", None)
    if check is not None:
        check(where)
    return obj


def _range(where: str, name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise CompressionConfigError(f"{where}.{name}: {value} is outside [{lo}, {hi}]")


# -- shared parameters -----------------------------------------------------------------------
@dataclass
class FP16MixedQuantize:
    """DeepSpeed's mixed fp16/quantized warm-up; accepted, only `enabled: false` is supported."""

    enabled: bool = False
    """Blend fp16 and quantized weights during warm-up (not supported: keep false)."""
    quantize_change_ratio: float = 0.001
    """Per-step blend increment (unused while `enabled` is false)."""

    def check(self, where: str) -> None:
        if self.enabled:
            raise CompressionConfigError(
                f"{where}.enabled: fp16_mixed_quantize is not supported; set it to false"
            )


@dataclass
class WeightQuantShared:
    """`weight_quantization.shared_parameters`."""

    enabled: bool = False
    """Turn weight quantization on."""
    quantizer_kernel: bool = False
    """DeepSpeed's CUDA quantizer kernel switch; the torch reference runs either way."""
    schedule_offset: int = 0
    """Training step at which quantization switches on."""
    quantize_groups: int = 1
    """Groups the flattened weight is split into, one scale each."""
    quantize_verbose: bool = False
    """Log bit changes."""
    quantization_type: Literal["symmetric", "asymmetric"] = "symmetric"
    """Symmetric (no zero point) or asymmetric (min/max with a zero point)."""
    quantize_weight_in_forward: bool = False
    """Quantize in every forward (here always the case: the weight is a parametrization)."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    """Rounding; only `nearest` is supported."""
    fp16_mixed_quantize: FP16MixedQuantize = field(default_factory=FP16MixedQuantize)
    """Mixed fp16/quantized warm-up (must stay disabled)."""

    def check(self, where: str) -> None:
        if self.schedule_offset < 0:
            raise CompressionConfigError(f"{where}.schedule_offset: {self.schedule_offset} < 0")
        if self.quantize_groups < 1:
            raise CompressionConfigError(f"{where}.quantize_groups: {self.quantize_groups} < 1")
        if self.rounding != "nearest":
            raise CompressionConfigError(
                f"{where}.rounding: 'stochastic' is not supported; use 'nearest'"
            )


@dataclass
class ActivationQuantShared:
    """`activation_quantization.shared_parameters`."""

    enabled: bool = False
    """Turn activation (layer input) quantization on."""
    quantization_type: Literal["symmetric", "asymmetric"] = "symmetric"
    """Symmetric or asymmetric token-wise ranges."""
    range_calibration: Literal["dynamic", "static"] = "dynamic"
    """Per-token ranges from each input (`dynamic`); `static` is not supported."""
    schedule_offset: int = 0
    """Training step at which activation quantization switches on."""

    def check(self, where: str) -> None:
        if self.range_calibration != "dynamic":
            raise CompressionConfigError(
                f"{where}.range_calibration: 'static' is not supported; use 'dynamic'"
            )


@dataclass
class PruningShared:
    """`sparse_pruning` / `row_pruning` / `channel_pruning` `.shared_parameters`."""

    enabled: bool = False
    """Turn this pruning method on."""
    method: Literal["l1", "topk"] = "l1"
    """`l1`: fixed mask from weight magnitudes at the offset; `topk`: learned scores."""
    schedule_offset: int = 0
    """Training step at which the mask switches on."""


@dataclass
class HeadPruningShared(PruningShared):
    """`head_pruning.shared_parameters`: adds the attention head count."""

    num_heads: int = 0
    """Heads of each pruned attention output projection."""

    def check(self, where: str) -> None:
        if self.enabled and self.num_heads < 1:
            raise CompressionConfigError(
                f"{where}.num_heads: {self.num_heads}; set the attention's head count (e.g. 12)"
            )


# -- per-group parameters --------------------------------------------------------------------
@dataclass
class WeightQuantParams:
    """`weight_quantization.different_groups.<name>.params`."""

    start_bits: int = 8
    """Bits when quantization switches on."""
    target_bits: int = 8
    """Bits it steps down to, one bit every `quantization_period` steps."""
    quantization_period: int = 1
    """Steps between bit reductions."""

    def check(self, where: str) -> None:
        _range(where, "start_bits", self.start_bits, 1, 16)
        _range(where, "target_bits", self.target_bits, 1, self.start_bits)
        if self.start_bits != self.target_bits and self.quantization_period < 1:
            raise CompressionConfigError(
                f"{where}.quantization_period: {self.quantization_period}; must be >= 1 when "
                f"start_bits {self.start_bits} != target_bits {self.target_bits}"
            )


@dataclass
class ActivationQuantParams:
    """`activation_quantization.different_groups.<name>.params`."""

    bits: int = 8
    """Activation bits (2..8)."""

    def check(self, where: str) -> None:
        _range(where, "bits", self.bits, 2, 8)


@dataclass
class PruningParams:
    """`*_pruning.different_groups.<name>.params`."""

    dense_ratio: float = 1.0
    """Fraction of weights / rows / heads / channels kept."""

    def check(self, where: str) -> None:
        if not 0.0 < self.dense_ratio <= 1.0:
            raise CompressionConfigError(
                f"{where}.dense_ratio: {self.dense_ratio} is outside (0, 1] (the fraction kept)"
            )


def _group_cls(params: type) -> type:
    """A `different_groups.<name>` block: `params` (of type `params`), `modules` (regexes over
    module names, `*` = every applicable module) and `related_modules` (per `modules` entry,
    the layers whose matching dims shrink with it at clean-up)."""
    return dataclasses.make_dataclass(
        f"Group{params.__name__}",
        [
            ("params", params, field(default_factory=params)),
            ("modules", list[str], field(default_factory=lambda: ["*"])),
            ("related_modules", typing.Optional[list[list[str]]], field(default=None)),  # noqa: UP045
        ],
    )


def _check_technique(self: Any, where: str) -> None:
    group = self._group
    self.different_groups = {
        name: parse(group, g, f"{where}.different_groups.{name}")
        for name, g in self.different_groups.items()
    }
    if self.shared_parameters.enabled and not self.different_groups:
        raise CompressionConfigError(
            f"{where}: enabled but `different_groups` is empty; add a group with "
            "`params` and `modules`"
        )


def _technique_cls(name: str, shared: type, params: type) -> type:
    """A technique block: `shared_parameters` (of type `shared`) and `different_groups`
    (named groups of modules with their own `params`)."""
    cls = dataclasses.make_dataclass(
        name,
        [
            ("shared_parameters", shared, field(default_factory=shared)),
            ("different_groups", dict[str, Any], field(default_factory=dict)),
        ],
        namespace={"check": _check_technique, "_group": _group_cls(params)},
    )
    return cls


WeightQuantization = _technique_cls("WeightQuantization", WeightQuantShared, WeightQuantParams)
ActivationQuantization = _technique_cls(
    "ActivationQuantization", ActivationQuantShared, ActivationQuantParams
)
SparsePruning = _technique_cls("SparsePruning", PruningShared, PruningParams)
RowPruning = _technique_cls("RowPruning", PruningShared, PruningParams)
HeadPruning = _technique_cls("HeadPruning", HeadPruningShared, PruningParams)
ChannelPruning = _technique_cls("ChannelPruning", PruningShared, PruningParams)


@dataclass
class LayerReduction:
    """`layer_reduction`: keep some of the teacher's layers (initialised from them)."""

    enabled: bool = False
    """Turn layer reduction on."""
    keep_number_layer: int = 0
    """How many layers the student keeps (= len(teacher_layer))."""
    module_name_prefix: str = ""
    """Name of the layer list, e.g. `encoder.layer` (BERT) or `layers` (LLaMA)."""
    teacher_layer: list[int] = field(default_factory=list)
    """Indices of the teacher layers the student starts from."""
    other_module_name: list[str] = field(default_factory=list)
    """Other modules copied from the teacher (embeddings, pooler, head); must exist."""

    def check(self, where: str) -> None:
        if self.enabled and self.keep_number_layer != len(self.teacher_layer):
            raise CompressionConfigError(
                f"{where}: keep_number_layer {self.keep_number_layer} != "
                f"len(teacher_layer) {len(self.teacher_layer)} ({self.teacher_layer})"
            )


@dataclass
class CompressionConfig:
    """DeepSpeed's `compression_training` block."""

    weight_quantization: WeightQuantization = field(default_factory=WeightQuantization)  # type: ignore[valid-type]
    """Quantization-aware training of weights, bits scheduled per group."""
    activation_quantization: ActivationQuantization = field(default_factory=ActivationQuantization)  # type: ignore[valid-type]
    """Token-wise fake quantization of layer inputs."""
    sparse_pruning: SparsePruning = field(default_factory=SparsePruning)  # type: ignore[valid-type]
    """Unstructured pruning at `dense_ratio`."""
    row_pruning: RowPruning = field(default_factory=RowPruning)  # type: ignore[valid-type]
    """Output-row pruning of Linear layers."""
    head_pruning: HeadPruning = field(default_factory=HeadPruning)  # type: ignore[valid-type]
    """Attention-head pruning on output projections."""
    channel_pruning: ChannelPruning = field(default_factory=ChannelPruning)  # type: ignore[valid-type]
    """Input-channel pruning of Conv/Linear layers."""
    layer_reduction: LayerReduction = field(default_factory=LayerReduction)
    """Keep a subset of the layers, initialised from a teacher."""


def load_compression_config(
    config: CompressionConfig | dict[str, Any] | str | os.PathLike[str],
) -> CompressionConfig:
    """A validated `CompressionConfig` from a dict, a JSON file path, or a config already built."""
    if isinstance(config, CompressionConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CompressionConfigError(f"cannot read compression config {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise CompressionConfigError(f"compression config must be an object, got {config!r}")
    if "compression_training" in config:
        return parse(CompressionConfig, config["compression_training"], "compression_training")
    return parse(CompressionConfig, config, "compression_training")
