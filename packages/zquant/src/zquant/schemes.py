"""Quantization schemes: which `nn.Linear` layers get which weight format and activation bits.

A scheme is a `Recipe` (the word of `z quantize --recipe` and of saved manifests): a default
`QuantSpec` for every linear layer, per-module `overrides` chosen by pattern, and `skip`
patterns kept in full precision. `Recipe.plan(model)` resolves it against a model into one
`LayerPlan` per layer and rejects, before anything is quantized, a pattern that matches no
layer or a spec that cannot apply to a layer's shape.

Patterns match a layer's qualified name (`encoder.layer.0.intermediate.dense`): a glob
(`*.mlp.*`, `fnmatch` rules, `*` crosses dots) or, prefixed with `re:`, a regular expression
that must match the whole name.

Named recipes (`get_recipe`), after ZeroQuant and FP6-LLM:

| name  | weights                                                  | activations        |
|-------|----------------------------------------------------------|--------------------|
| w8a8  | INT8 symmetric per output channel                        | INT8 token-wise    |
| w4a8  | INT4 group-wise in the MLP, INT8 per channel in attention | INT8 token-wise    |
| w6a16 | FP6 (e3m2) per output channel                            | full precision     |
| w8    | INT8 per output channel                                  | full precision     |
| w4    | INT4 group-wise (group 32 unless `group_size` says)      | full precision     |
| xtc   | binary (sign x per-channel scale), see `zquant.xtc`      | full precision     |

The `a8` recipes keep the `ACT_OUTLIERS` (8) largest activation channels of each call in
full precision (`nn.OutlierQuantLinear`, LLM.int8()'s decomposition), which brings W8A8
most of the way back to fp32 on MiniLM and SmolLM2 (`benchmarks/results/quant-accuracy.md`).
Set `act_outliers=0` for plain token-wise INT8.

The output heads (`lm_head`, BERT's `pooler.dense`) stay in full precision by default
(`keep`), as in ZeroQuant: the head is tied to the embeddings in most small models.
`lm_head="int8"` (`z quantize --lm-head int8`) quantizes the LM head like a W8A8 projection
instead: INT8 symmetric per output row, INT8 token-wise activations (`HEAD_ACT_OUTLIERS`
channels kept in full precision), so it runs on the INT8 GEMM. A tied head is quantized on
its own: the input embedding table stays full precision beside it (see `zquant.serialize`).
This is the precision llama.cpp's Q8_0/Q4_1 GGUFs give SmolLM2's tied `token_embd` (Q8_0),
and it matters at batch 1: SmolLM2-135M's 49152 x 576 fp32 head is 113 MB read per decoded
token, about half of what a W8A8/W4 decode step reads; INT8 makes it 28 MB, at a
perplexity cost measured in `benchmarks/results/quant-accuracy.md`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from zquant.quantizers import QuantSpec

# Linear layers inside the feed-forward (MLP) part of a block, across the LLaMA/Mistral
# (`mlp.gate_proj`), GPT-2/NeoX (`mlp.c_fc`, `mlp.dense_h_to_4h`) and BERT
# (`intermediate.dense`, `layer.N.output.dense` but not `attention.output.dense`) families.
MLP_PATTERN = (
    r"re:(.*\.)?(mlp|feed_forward|ffn)\..*|.*\.intermediate\.dense|.*\.layer\.\d+\.output\.dense"
)
DEFAULT_KEEP: tuple[str, ...] = ("lm_head", "*.lm_head", "pooler.dense", "*.pooler.dense")
DEFAULT_GROUP_SIZE = 32
# Activation channels the INT8-activation recipes keep in full precision (`OutlierQuantLinear`).
ACT_OUTLIERS = 8
ACT_BITS = tuple(range(2, 9))
RECIPE_NAMES = ("w8a8", "w4a8", "w6a16", "w8", "w4", "xtc")
#: The output-head layers `Recipe.lm_head` applies to (causal LMs' `lm_head`).
HEAD_PATTERNS: tuple[str, ...] = ("lm_head", "*.lm_head")
#: `Recipe.lm_head` values: None keeps the head in full precision; `int8` is W8A8's format.
LM_HEAD_FORMATS = ("int8",)
#: Activation channels a quantized head keeps in full precision (as the `a8` recipes).
HEAD_ACT_OUTLIERS = ACT_OUTLIERS


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether layer `name` matches `pattern` (a glob, or `re:` + a full-match regex)."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def _check_pattern(pattern: str, where: str) -> None:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{where}: pattern must be a non-empty string, got {pattern!r}")
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise ValueError(
                f"{where}: pattern {pattern!r} is not a valid regular expression ({exc}); "
                "fix the regex or drop the `re:` prefix to use a glob"
            ) from exc


def _check_act_bits(act_bits: int | None, where: str) -> None:
    if act_bits is not None and act_bits not in ACT_BITS:
        raise ValueError(
            f"{where}: act_bits={act_bits!r} is out of range; use 2..8 (8 for W8A8, "
            "token-wise INT activations) or None for full-precision activations"
        )


def _check_weight_spec(weight: Any, where: str, layer: str) -> None:
    if not isinstance(weight, QuantSpec):
        raise TypeError(f"{where}: weight must be a QuantSpec, got {type(weight).__name__}")
    weight.validate(layer=layer)


@dataclass(frozen=True)
class LayerRule:
    """Per-module override: layers whose name matches `pattern` use `weight` / `act_bits`."""

    pattern: str
    """Glob over the qualified layer name, or `re:` + a regular expression (full match)."""
    weight: QuantSpec
    """Weight format of the matched layers."""
    act_bits: int | None = None
    """Token-wise activation bits of the matched layers (None: full precision)."""
    required: bool = True
    """Fail when the pattern matches no linear layer (a typo would otherwise do nothing)."""
    act_outliers: int = 0
    """Activation channels kept in full precision per call (see `nn.OutlierQuantLinear`)."""

    def __post_init__(self) -> None:
        _check_pattern(self.pattern, "override")
        where = f"override {self.pattern!r}"
        _check_weight_spec(self.weight, where, where)
        _check_act_bits(self.act_bits, where)


@dataclass(frozen=True)
class LayerPlan:
    """What `quantize` does to one linear layer (the resolved recipe)."""

    name: str
    """Qualified module name in the model."""
    shape: tuple[int, int]
    """(out_features, in_features) of the weight."""
    weight: QuantSpec
    act_bits: int | None
    act_outliers: int = 0
    """Largest activation channels left in full precision (0: none)."""


@dataclass(frozen=True)
class Recipe:
    """A quantization recipe; validated at construction, resolved per model by `plan`."""

    name: str
    """Label recorded in the manifest of a saved model (`w8a8`, `w4`, or your own)."""
    weight: QuantSpec
    """Default weight format of every linear layer not overridden or skipped."""
    act_bits: int | None = None
    """Default token-wise activation bits (8 for the `a8` recipes; None: full precision)."""
    overrides: tuple[LayerRule, ...] = ()
    """Per-module formats; the last rule that matches a layer wins."""
    skip: tuple[str, ...] = ()
    """Patterns of layers kept in full precision; each must match at least one layer."""
    keep: tuple[str, ...] = DEFAULT_KEEP
    """Layers kept in full precision when present (need not match: heads, poolers)."""
    method: str = "ptq"
    """`ptq` (round-to-nearest, data-free) or `xtc` (binary/ternary; see `zquant.xtc`)."""
    act_outliers: int = 0
    """With `act_bits`: the largest activation channels (per call) kept in full precision,
    LLM.int8()-style; the `a8` recipes keep `ACT_OUTLIERS`."""
    lm_head: str | None = None
    """The output head's format (`HEAD_PATTERNS`), whatever `keep` says: None keeps it in
    full precision; `"int8"` is INT8 per output row with INT8 token-wise activations (W8A8's
    kernel, `HEAD_ACT_OUTLIERS` outlier channels). The model must have such a layer."""

    def __post_init__(self) -> None:
        if self.method not in ("ptq", "xtc"):
            raise ValueError(
                f"recipe {self.name!r}: unknown method {self.method!r}; use 'ptq' or 'xtc'"
            )
        if self.lm_head is not None and self.lm_head not in LM_HEAD_FORMATS:
            raise ValueError(
                f"recipe {self.name!r}: lm_head={self.lm_head!r} is not supported; use "
                "'int8' (INT8 per-row weights, INT8 token-wise activations) or leave `lm_head` "
                "unset to keep the head in full precision"
            )
        where = f"recipe {self.name!r}"
        _check_weight_spec(self.weight, where, f"{where} default weight")
        _check_act_bits(self.act_bits, where)
        for where, k in [(f"recipe {self.name!r}", self.act_outliers)] + [
            (f"override {r.pattern!r}", r.act_outliers) for r in self.overrides
        ]:
            if not isinstance(k, int) or k < 0:
                raise ValueError(f"{where}: act_outliers={k!r} must be an int >= 0; use e.g. 8")
        for pattern in (*self.skip, *self.keep):
            _check_pattern(pattern, f"recipe {self.name!r} skip")
        object.__setattr__(self, "overrides", tuple(self.overrides))
        object.__setattr__(self, "skip", tuple(self.skip))
        object.__setattr__(self, "keep", tuple(self.keep))

    def resolve(self, name: str) -> tuple[QuantSpec, int | None, int] | None:
        """(weight spec, act bits, act outliers) of the layer `name`, or None when it stays
        full precision."""
        if any(pattern_matches(p, name) for p in self.skip):
            return None
        if self.lm_head is not None and any(pattern_matches(p, name) for p in HEAD_PATTERNS):
            return QuantSpec(bits=8, granularity="channel"), 8, HEAD_ACT_OUTLIERS
        if any(pattern_matches(p, name) for p in self.keep):
            return None
        spec, act, outliers = self.weight, self.act_bits, self.act_outliers
        for rule in self.overrides:
            if pattern_matches(rule.pattern, name):
                spec, act, outliers = rule.weight, rule.act_bits, rule.act_outliers
        return spec, act, outliers

    def plan(self, model: nn.Module) -> list[LayerPlan]:
        """One `LayerPlan` per quantized `nn.Linear` of `model`, in module order.

        Raises ValueError, naming the pattern and some layer names, when an override or
        `skip` pattern matches no linear layer; and, naming the layer and its shape, when a
        spec does not apply to a layer (`QuantSpec.validate`).
        """
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        names = [n for n, _ in linears]
        shapes = [f"{n} {(m.out_features, m.in_features)}" for n, m in linears]
        for pattern, required in [(r.pattern, r.required) for r in self.overrides] + [
            (p, True) for p in self.skip
        ]:
            if required and not any(pattern_matches(pattern, n) for n in names):
                sample = ", ".join(shapes[:3]) + (", ..." if len(shapes) > 3 else "")
                raise ValueError(
                    f"recipe {self.name!r}: pattern {pattern!r} matches none of the "
                    f"{len(names)} linear layers ({sample or 'none'}); fix the pattern "
                    "(globs match the full dotted name, `re:` patterns must match it whole)"
                )
        if self.lm_head is not None and not any(
            self.resolve(n) is not None and any(pattern_matches(p, n) for p in HEAD_PATTERNS)
            for n in names
        ):
            raise ValueError(
                f"recipe {self.name!r}: lm_head={self.lm_head!r}, but the model has no "
                f"unskipped linear layer named {' or '.join(HEAD_PATTERNS)} (an encoder, or "
                "the head is in `skip`); leave `lm_head` unset"
            )
        plans = []
        for name, module in linears:
            resolved = self.resolve(name)
            if resolved is None:
                continue
            spec, act, outliers = resolved
            shape = (module.out_features, module.in_features)
            spec.validate(layer=name, shape=shape)
            plans.append(LayerPlan(name, shape, spec, act, outliers if act is not None else 0))
        return plans

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the manifest of a saved model); `Recipe.from_dict` reverses it."""
        return {
            "name": self.name,
            "method": self.method,
            "weight": self.weight.to_dict(),
            "act_bits": self.act_bits,
            "act_outliers": self.act_outliers,
            "overrides": [
                {
                    "pattern": r.pattern,
                    "weight": r.weight.to_dict(),
                    "act_bits": r.act_bits,
                    "required": r.required,
                    "act_outliers": r.act_outliers,
                }
                for r in self.overrides
            ],
            "skip": list(self.skip),
            "keep": list(self.keep),
            "lm_head": self.lm_head,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recipe:
        """Rebuild a recipe from `to_dict()` output (or hand-written JSON of the same shape)."""
        if not isinstance(data, dict):
            raise TypeError(f"a recipe is a JSON object, got {type(data).__name__}")
        known = {
            "name",
            "method",
            "weight",
            "act_bits",
            "act_outliers",
            "overrides",
            "skip",
            "keep",
            "lm_head",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"recipe: unknown key(s) {unknown}; known keys: {sorted(known)}")
        if "weight" not in data:
            raise ValueError("recipe: missing 'weight' (e.g. {'bits': 8}); add it")
        return cls(
            name=str(data.get("name", "custom")),
            method=data.get("method", "ptq"),
            weight=_spec(data["weight"], "weight"),
            act_bits=data.get("act_bits"),
            act_outliers=data.get("act_outliers", 0),
            overrides=tuple(
                LayerRule(
                    pattern=r["pattern"],
                    weight=_spec(r["weight"], f"override {r.get('pattern')!r}"),
                    act_bits=r.get("act_bits"),
                    required=r.get("required", True),
                    act_outliers=r.get("act_outliers", 0),
                )
                for r in data.get("overrides", ())
            ),
            skip=tuple(data.get("skip", ())),
            keep=tuple(data.get("keep", DEFAULT_KEEP)),
            lm_head=data.get("lm_head"),
        )


def _spec(data: Any, where: str) -> QuantSpec:
    if not isinstance(data, dict):
        raise TypeError(f"{where}: a weight spec is a JSON object, got {data!r}")
    fields = [f.name for f in dataclasses.fields(QuantSpec)]
    unknown = sorted(set(data) - set(fields))
    if unknown or "bits" not in data:
        raise ValueError(
            f"{where}: bad weight spec {data!r} (unknown {unknown}, or no 'bits'); fields: {fields}"
        )
    spec = QuantSpec(**data)
    spec.validate(layer=where)
    return spec


def get_recipe(
    name: str,
    *,
    group_size: int | None = None,
    overrides: tuple[LayerRule, ...] = (),
    skip: tuple[str, ...] = (),
    lm_head: str | None = None,
) -> Recipe:
    """The named recipe (`RECIPE_NAMES`), with extra `overrides` / `skip` patterns and the
    output head's format (`Recipe.lm_head`: None keeps it full precision, or `"int8"`).

    `group_size` sets the INT4 group of `w4` / `w4a8` (default 32); for the others it makes
    the weights group-wise at that size. A group that does not divide a layer's input width
    pads the last group (e.g. 128 on a 576-wide model).
    """
    if group_size is not None and (not isinstance(group_size, int) or group_size <= 0):
        raise ValueError(
            f"recipe {name!r}: group_size={group_size!r} must be a positive integer "
            f"(e.g. {DEFAULT_GROUP_SIZE} or 128)"
        )

    def grouped(bits: int, fmt: str = "int", default: int | None = None) -> QuantSpec:
        size = group_size if group_size is not None else default
        if size is None:
            return QuantSpec(bits=bits, fmt=fmt, granularity="channel")
        return QuantSpec(bits=bits, fmt=fmt, granularity="group", group_size=size)

    extra: dict[str, Any] = {"overrides": tuple(overrides), "skip": tuple(skip), "lm_head": lm_head}
    if name == "w8a8":
        return Recipe(name, grouped(8), act_bits=8, act_outliers=ACT_OUTLIERS, **extra)
    if name == "w8":
        return Recipe(name, grouped(8), **extra)
    if name == "w6a16":
        return Recipe(name, grouped(6, "fp6"), **extra)
    if name == "w4":
        return Recipe(name, grouped(4, default=DEFAULT_GROUP_SIZE), **extra)
    if name == "w4a8":
        mlp = LayerRule(
            MLP_PATTERN,
            grouped(4, default=DEFAULT_GROUP_SIZE),
            act_bits=8,
            act_outliers=ACT_OUTLIERS,
        )
        return Recipe(
            name,
            QuantSpec(bits=8, granularity="channel"),
            act_bits=8,
            act_outliers=ACT_OUTLIERS,
            overrides=(mlp, *overrides),
            skip=tuple(skip),
            lm_head=lm_head,
        )
    if name == "xtc":
        return Recipe(name, grouped(1, "binary"), method="xtc", **extra)
    raise ValueError(
        f"unknown recipe {name!r}; use one of {', '.join(RECIPE_NAMES)} or build a zquant.Recipe"
    )


__all__ = [
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_KEEP",
    "HEAD_ACT_OUTLIERS",
    "HEAD_PATTERNS",
    "LM_HEAD_FORMATS",
    "MLP_PATTERN",
    "RECIPE_NAMES",
    "LayerPlan",
    "LayerRule",
    "Recipe",
    "get_recipe",
    "pattern_matches",
]
