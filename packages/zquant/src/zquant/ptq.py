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

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from zquant.nn import QuantLinear
from zquant.quantizers import QuantizedWeight, quantize_weight
from zquant.schemes import LayerPlan, Recipe


def get_submodule_parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(parent module, attribute name) of the submodule `name` (`a.b.c` -> (a.b, "c"))."""
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def swap_layer(model: nn.Module, plan: LayerPlan) -> QuantLinear:
    """Quantize the `nn.Linear` at `plan.name` and put a `QuantLinear` in its place."""
    parent, child = get_submodule_parent(model, plan.name)
    linear = getattr(parent, child)
    if not isinstance(linear, nn.Linear):
        raise TypeError(
            f"layer {plan.name!r} is {type(linear).__name__}, not nn.Linear; "
            "re-plan the recipe on the unquantized model"
        )
    qlinear = make_quant_linear(linear, plan)
    setattr(parent, child, qlinear)
    return qlinear


def make_quant_linear(
    linear: nn.Linear, plan: LayerPlan, *, qweight: QuantizedWeight | None = None
) -> QuantLinear:
    """The `QuantLinear` for `linear` per `plan` (an `OutlierQuantLinear` when the plan keeps
    activation outlier channels in full precision). `qweight`: the already quantized weight
    (GPTQ); by default `linear.weight` is rounded to nearest."""
    if qweight is None:
        qweight = quantize_weight(linear.weight.detach(), plan.weight, layer=plan.name)
    if plan.act_outliers and plan.act_bits is not None:
        layer = OutlierQuantLinear(qweight, linear.bias, plan.act_bits, name=plan.name)
        return layer.set_outliers(min(plan.act_outliers, linear.in_features))
    return QuantLinear(qweight, linear.bias, plan.act_bits, name=plan.name)


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
        from zquant.gptq import quantize_gptq

        return quantize_gptq(model, recipe, calib, **options)
    if calib is not None:
        from zquant.lkd import distill

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


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """Every `QuantLinear` of `model` by qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


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


class OutlierQuantLinear(QuantLinear):
    """A `QuantLinear` whose token-wise activation quantization leaves the `act_outliers`
    largest input channels in full precision (LLM.int8()'s decomposition, data-free).

    Transformer activations carry a few channels tens of times larger than the rest (BERT's
    and LLaMA's residual-stream outliers); one per-token INT8 scale then spends its range on
    them and rounds every other channel coarsely. Per call, the `k` channels with the largest
    magnitude over all tokens are taken out: the rest go through the layer's INT8 path and the
    `k` columns are multiplied in fp32 with the same (dequantized) weight columns:

        y = Q(x with columns C zeroed) @ W_q^T + x[:, C] @ W_q[:, C]^T        C: (k,) indices

    On all-MiniLM-L6-v2 W8A8 this lifts the embedding cosine from 0.9965 to 0.999 with k=2..8.
    The count is kept in the `qoutliers` buffer so a saved model reloads the same.
    """

    def set_outliers(self, k: int) -> OutlierQuantLinear:
        """Keep `k` (0..in_features) activation channels in full precision; returns self."""
        if not isinstance(k, int) or not 0 <= k <= self.in_features:
            raise ValueError(
                f"layer {self.name!r} (weight shape {(self.out_features, self.in_features)}): "
                f"act_outliers={k!r} must be an int in 0..{self.in_features}; use e.g. 8"
            )
        self.register_buffer("qoutliers", torch.tensor(k, dtype=torch.int64))
        return self

    @property
    def act_outliers(self) -> int:
        buffer = getattr(self, "qoutliers", None)
        return 0 if buffer is None else int(buffer)

    def _weight_columns(self, cols: torch.Tensor) -> torch.Tensor:
        """Dequantized weight columns `cols`, (out, k)."""
        if self.path == "w8a8":  # INT8 per channel/tensor: codes times the row scale
            return self.qdata[:, cols].to(torch.float32) * self.qscale.reshape(-1, 1)
        return self.dequantized_weight()[:, cols]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.act_outliers
        if not k or self.act_bits is None:
            return super().forward(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.float32)  # (tokens, in)
        cols = x2.abs().amax(0).topk(k).indices  # (k,)
        outliers = x2[:, cols]  # (tokens, k)
        y = super().forward(x2.index_fill(1, cols, 0.0))  # (tokens, out)
        y = y + outliers @ self._weight_columns(cols).t()
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, act_outliers={self.act_outliers}"
