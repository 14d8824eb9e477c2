"""A QLoRA-style frozen base: the frozen linear weights of a LoRA model stored quantized.

`quantize_frozen_base` swaps every frozen `nn.Linear` of a model (each `peft` LoRA layer's
`base_layer`, and the linears no adapter touches) for a `zquant.QuantLinear` holding the
weight as packed INT8 (one scale per output channel) or INT4 (one scale per group of 64
inputs), round-to-nearest, bitsandbytes-free. The forward dequantizes the weight and
multiplies; gradients flow through it to the adapters and the input, never into the
weight. The output head (`lm_head`) stays full precision, as QLoRA keeps it.

Under `zcore.hf.Trainer` nothing else changes: the packed weights are module buffers, not
parameters, so the ZeRO engine (stage 2 or 3) optimises, reduces and shards only the
trainable adapters (and at stage 3 partitions the remaining full-precision parameters:
embeddings, norms, the head); every rank holds the packed base whole. The quantization
needs each linear's whole weight, so the model is built unpartitioned, then quantized,
then handed to the engine. The adapter saves as a plain PEFT adapter over the unquantized
base's names, so `PeftModel.from_pretrained` loads it over the original model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

BITS = (8, 4)
"""The base weight formats: INT8 per channel, INT4 per group of :data:`GROUP_SIZE`."""
GROUP_SIZE = 64
KEEP = ("lm_head",)
"""Module names (last part) kept in full precision."""


@dataclass(frozen=True)
class QuantizedBase:
    """What :func:`quantize_frozen_base` did."""

    layers: int
    """Linears swapped."""
    bytes_before: int
    """Their fp32 weight bytes."""
    bytes_after: int
    """Their packed bytes (codes + scales)."""


def spec_for(bits: int) -> object:
    """The zquant weight spec of `bits` (8 or 4)."""
    from zquant.spec import QuantSpec

    if bits == 8:
        return QuantSpec(bits=8, granularity="channel")
    if bits == 4:
        return QuantSpec(bits=4, granularity="group", group_size=GROUP_SIZE)
    raise ValueError(f"base bits {bits} is not supported; use one of {list(BITS)}")


def quantize_frozen_base(model: nn.Module, bits: int) -> QuantizedBase:
    """Swap every frozen `nn.Linear` of `model` (but the head) for a packed `QuantLinear`."""
    from zquant.nn import QuantLinear

    spec = spec_for(bits)
    swapped, before, after = 0, 0, 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear or child.weight.requires_grad:
                continue
            if child_name in KEEP or hasattr(child.weight, "z_shape"):
                continue  # the head; or a stage-3 partition (quantize before partitioning)
            full = f"{name}.{child_name}" if name else child_name
            q = QuantLinear.from_linear(child, spec, name=full)  # type: ignore[arg-type]
            setattr(module, child_name, q)
            swapped += 1
            before += child.weight.numel() * child.weight.element_size()
            after += q.nbytes()
    if not swapped:
        raise ValueError(
            "the model has no frozen nn.Linear to quantize: apply the LoRA adapter first "
            "(its base layers are frozen) and build the model unpartitioned"
        )
    return QuantizedBase(swapped, before, after)
