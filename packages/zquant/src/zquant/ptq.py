"""ZeroQuant post-training quantization: swap `nn.Linear` for `QuantLinear`, one layer at a time.

`quantize(model, recipe)` is data-free round-to-nearest quantization: the recipe is
resolved against the model first (`Recipe.plan`, which rejects bad patterns and shapes
before anything changes), then every planned layer is quantized and swapped in place,
in module order.

Memory: each layer's fp32 weight is released as soon as its `QuantLinear` replaces it, so
while layer k is quantized the live fp32 weights are the not-yet-quantized layers plus the
temporaries of layer k alone. The extra memory quantization needs above the model is thus
set by the largest layer (its fp32 weight and the quantizer's temporaries), never by the
model, and the fp32 footprint shrinks monotonically as the walk proceeds.
`tests/zquant/test_ptq.py` checks this by counting the fp32 weight bytes still alive after
every layer. (Tied weights, e.g. an output head shared with the embeddings, stay alive
through the other module that holds them.)

With `calib` (calibration batches), quantization is followed by ZeroQuant's layer-by-layer
knowledge distillation (`zquant.lkd.distill`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

from torch import nn

from zquant.gptq import quantize_gptq
from zquant.lkd import distill
from zquant.nn import OutlierQuantLinear as _OutlierQuantLinear
from zquant.nn import QuantLinear
from zquant.schemes import LayerPlan, Recipe
from zquant.swap import quantized_layers, swap_layer


def quantize(
    model: nn.Module,
    recipe: Recipe,
    *,
    calib: Sequence[dict[str, Any]] | None = None,
    rounding: Literal["nearest", "gptq"] = "nearest",
    on_layer: Callable[[LayerPlan, QuantLinear], None] | None = None,
    **options: Any,
) -> nn.Module:
    """Quantize `model` in place per `recipe` and return it.

    `calib`: calibration batches (dicts of model inputs such as `input_ids` and
    `attention_mask`). With `rounding="nearest"` (default) and `calib`, each transformer block
    is then distilled from a full-precision copy (`zquant.lkd.distill`, taking `options`);
    without `calib` the quantization is data-free. `rounding="gptq"` rounds with GPTQ on
    `calib` instead (`zquant.gptq.quantize_gptq`, taking `options`). `on_layer(plan,
    qlinear)` is called after every round-to-nearest swap (for progress output or memory
    accounting). Recipes with `method="xtc"` binarize or ternarize the weights the same way:
    data-free, or refined block by block with LKD when `calib` is given; XTC's full recipe
    (layer reduction, then distillation training of the 1-bit student) is
    `zquant.xtc.xtc_compress`.
    """
    if rounding not in ("nearest", "gptq"):
        raise ValueError(f"rounding={rounding!r} is unknown; use 'nearest' or 'gptq'")
    if recipe.method == "xtc":
        if rounding == "gptq":
            raise ValueError("the xtc recipe binarizes weights; GPTQ rounds int/fp6 recipes only")
    if rounding == "gptq":
        if calib is None:
            raise ValueError(
                "rounding='gptq' needs calib= calibration batches "
                "(zquant.lkd.calibration_batches(tokenizer, sentences))"
            )
        return quantize_gptq(model, recipe, calib, **options)
    if calib is not None:
        return distill(model, recipe, calib, **options)
    if options:
        raise TypeError(
            f"quantize() got LKD options {sorted(options)} without calib; "
            "pass calib= calibration batches or drop the options"
        )
    plans = recipe.plan(model)
    for plan in plans:
        qlinear = swap_layer(model, plan)
        if on_layer is not None:
            on_layer(plan, qlinear)
    return model


def model_size(model: nn.Module) -> dict[str, int]:
    """Bytes of `model` as stored, and what the same parameters take in fp16.

    Keys: `linear_bytes` (packed codes + scales of the quantized layers), `linear_fp16_bytes`
    (their weights + biases in fp16), `other_bytes` (every other parameter, counted in fp16
    as a half-precision deployment stores them), `total_bytes` and `fp16_bytes` (the whole
    model). Tied parameters count once.
    """
    seen: set[int] = set()
    linear = linear_fp16 = 0
    for module in quantized_layers(model).values():
        linear += module.nbytes()
        linear_fp16 += 2 * module.in_features * module.out_features
        if module.bias is not None:
            linear_fp16 += 2 * module.bias.numel()
            seen.add(id(module.bias))
    other = 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        other += 2 * param.numel()
    return {
        "linear_bytes": linear,
        "linear_fp16_bytes": linear_fp16,
        "other_bytes": other,
        "total_bytes": linear + other,
        "fp16_bytes": linear_fp16 + other,
    }


def __getattr__(name: str) -> Any:
    # OutlierQuantLinear is a layer: it lives in zquant.nn (zquant.OutlierQuantLinear) now.
    if name == "OutlierQuantLinear":
        warnings.warn(
            "`zquant.ptq.OutlierQuantLinear` is deprecated: import it from `zquant.nn` "
            "(or use `zquant.OutlierQuantLinear`)",
            DeprecationWarning,
            stacklevel=2,
        )
        return _OutlierQuantLinear
    raise AttributeError(f"module 'zquant.ptq' has no attribute {name!r}")
