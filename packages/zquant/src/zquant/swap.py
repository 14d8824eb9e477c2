"""Putting quantized layers into a model, the step every pass shares.

`quantize` (round-to-nearest), `distill` (LKD) and `quantize_gptq` each decide a layer's
weights their own way and then put a `QuantLinear` (an `OutlierQuantLinear` where the plan
keeps activation outliers) where its `nn.Linear` was; `load_quantized` puts them back from a
file. Finding them again is `quantized_layers`.
"""

from __future__ import annotations

from torch import nn

from zquant.nn import OutlierQuantLinear, QuantLinear
from zquant.quantizers import QuantizedWeight, quantize_weight
from zquant.schemes import LayerPlan


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


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """Every `QuantLinear` of `model` by qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
