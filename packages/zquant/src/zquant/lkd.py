"""ZeroQuant's layer-by-layer knowledge distillation (LKD).

Each transformer block of the quantized model (the student) is tuned, one block at a time,
to reproduce its full-precision twin's (the teacher's) output from the same input:

    loss_k = MSE(teacher_block_k(x_k), student_block_k(x_k)),   x_k = the teacher's input

where `x_k` is what the full-precision model feeds block k on real calibration text. Only
block k's quantized linear weights and biases train; their weights pass through
`fake_quantize` (round-to-nearest forward, straight-through gradient), so the tuning moves
each weight across rounding boundaries in whatever direction reduces the block's output
error. After its steps the block's layers are packed into `QuantLinear`s with the tuned
weights, and the walk moves to the next block. Memory is one block's activations and
gradients; no end-to-end backward pass is ever run (the point of LKD).

The calibration batches are dicts of model inputs (`input_ids`, `attention_mask`);
`calibration_batches` builds them from sentences with the model's tokenizer.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zquant.nn import QuantLinear
from zquant.quantizers import QuantSpec, fake_quantize, fake_quantize_activation
from zquant.schemes import LayerPlan, Recipe
from zquant.swap import get_submodule_parent, make_quant_linear, swap_layer


class FakeQuantLinear(nn.Module):
    """A trainable linear whose forward quantizes weights (and activations) like `QuantLinear`."""

    def __init__(
        self, linear: nn.Linear, spec: QuantSpec, act_bits: int | None, act_outliers: int = 0
    ) -> None:
        super().__init__()
        self.act_outliers = act_outliers
        self.weight = nn.Parameter(linear.weight.detach().clone().float())
        self.bias = (
            None if linear.bias is None else nn.Parameter(linear.bias.detach().clone().float())
        )
        self.spec = spec
        self.act_bits = act_bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_bits is not None and self.act_outliers:
            # as OutlierQuantLinear: the largest channels skip activation quantization
            cols = x.detach().abs().flatten(0, -2).amax(0).topk(self.act_outliers).indices
            keep = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
            keep[cols] = True
            x = torch.where(
                keep, x, fake_quantize_activation(x.masked_fill(keep, 0.0), self.act_bits)
            )
        elif self.act_bits is not None:
            x = fake_quantize_activation(x, self.act_bits)
        return F.linear(x, fake_quantize(self.weight, self.spec), self.bias)

    def to_linear(self) -> nn.Linear:
        """A plain `nn.Linear` holding the tuned full-precision weights."""
        out, in_ = self.weight.shape
        linear = nn.Linear(in_, out, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.weight.detach())
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach())
        return linear


def find_blocks(model: nn.Module) -> str:
    """Qualified name of the model's stack of transformer blocks (an `nn.ModuleList`).

    The `ModuleList` holding the most linear layers: `encoder.layer` for BERT,
    `model.layers` for LLaMA, `transformer.h` for GPT-2.
    """
    best, best_count = "", 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            count = sum(isinstance(m, nn.Linear | QuantLinear) for m in module.modules())
            if count > best_count:
                best, best_count = name, count
    if not best_count:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of blocks with linear layers; "
            "LKD needs a transformer block stack (use plain zquant.quantize instead)"
        )
    return best


def calibration_batches(
    tokenizer: Any, sentences: Sequence[str], *, batch_size: int = 16, max_length: int = 64
) -> list[dict[str, torch.Tensor]]:
    """Tokenized batches (`input_ids`, `attention_mask`, padded right) of `sentences`."""
    if not sentences:
        raise ValueError("calibration needs at least one sentence; pass real text")
    return [
        dict(
            tokenizer(
                list(sentences[i : i + batch_size]),
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
        )
        for i in range(0, len(sentences), batch_size)
    ]


@dataclass
class _BlockIO:
    """Block k's captured (args, kwargs) inputs and output per calibration batch."""

    inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)


def _hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple | list) else output


@torch.no_grad()
def capture_blocks(
    model: nn.Module,
    blocks: nn.ModuleList,
    calib: Sequence[dict[str, Any]],
    *,
    outputs: bool = True,
    later_hidden: bool = True,
) -> list[_BlockIO]:
    """Per block, its (args, kwargs) call on every calibration batch and, with `outputs`,
    its output hidden states. `later_hidden=False` drops the hidden-state input of every
    block after the first (for a caller that propagates its own, as GPTQ does)."""
    records = [_BlockIO() for _ in blocks]
    handles = []
    for k, (block, record) in enumerate(zip(blocks, records, strict=True)):

        def pre(_m: nn.Module, args: Any, kwargs: Any, k: int = k, rec: _BlockIO = record) -> None:
            args, kwargs = tuple(args), dict(kwargs)
            if k and not later_hidden:
                if args:
                    args = (None, *args[1:])
                else:
                    kwargs["hidden_states"] = None
            rec.inputs.append((args, kwargs))

        def post(_m: nn.Module, _args: Any, output: Any, rec: _BlockIO = record) -> None:
            rec.outputs.append(_hidden(output).detach())

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        if outputs:
            handles.append(block.register_forward_hook(post))
    # A KV cache in the captured kwargs would grow on every tuning step: run without one.
    extra = (
        {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    )
    try:
        for batch in calib:
            model(**batch, **extra)
    finally:
        for handle in handles:
            handle.remove()
    return records


def _masked_mse(
    pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    if mask is None or mask.shape != pred.shape[:2]:
        return F.mse_loss(pred, target)
    weight = mask.to(pred.dtype).unsqueeze(-1)  # (B, T, 1): padding positions do not count
    return ((pred - target) ** 2 * weight).sum() / (weight.sum() * pred.shape[-1]).clamp_min(1.0)


def distill(
    model: nn.Module,
    recipe: Recipe,
    calib: Sequence[dict[str, Any]],
    *,
    steps: int = 20,
    lr: float = 5e-5,
    teacher: nn.Module | None = None,
) -> nn.Module:
    """Quantize `model` in place per `recipe`, distilling each block from `teacher`; return it.

    `teacher` defaults to a full-precision deep copy of `model` taken first. `steps` passes
    over the calibration batches per block (Adam, learning rate `lr`). Planned layers outside
    the block stack are quantized round-to-nearest.
    """
    if steps < 0 or lr <= 0:
        raise ValueError(f"LKD needs steps >= 0 and lr > 0, got steps={steps}, lr={lr}")
    if not calib:
        raise ValueError("LKD needs calibration batches; pass calibration_batches(...)")
    plans = recipe.plan(model)
    teacher = copy.deepcopy(model) if teacher is None else teacher
    teacher.eval()
    prefix = find_blocks(model)
    blocks = model.get_submodule(prefix)
    assert isinstance(blocks, nn.ModuleList)
    records = capture_blocks(teacher, teacher.get_submodule(prefix), calib)
    masks = [batch.get("attention_mask") for batch in calib]

    by_block: dict[int, list[LayerPlan]] = {}
    outside: list[LayerPlan] = []
    for plan in plans:
        head, _, rest = plan.name.partition(prefix + ".") if prefix else ("", "", plan.name)
        index = rest.split(".", 1)[0]
        if head == "" and rest and index.isdigit():
            by_block.setdefault(int(index), []).append(plan)
        else:
            outside.append(plan)

    was_training = model.training
    model.eval()  # no dropout while matching the teacher
    requires = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        for k, block in enumerate(blocks):
            _tune_block(model, block, by_block.get(k, []), records[k], masks, steps, lr)
            records[k] = _BlockIO()  # free block k's activations
    finally:
        for p, flag in requires.items():
            p.requires_grad_(flag)
        model.train(was_training)
    for plan in outside:
        swap_layer(model, plan)
    return model


def _tune_block(
    model: nn.Module,
    block: nn.Module,
    plans: list[LayerPlan],
    record: _BlockIO,
    masks: list[torch.Tensor | None],
    steps: int,
    lr: float,
) -> None:
    if not plans:
        return
    fakes: list[tuple[LayerPlan, FakeQuantLinear]] = []
    for plan in plans:
        parent, child = get_submodule_parent(model, plan.name)
        fake = FakeQuantLinear(
            getattr(parent, child), plan.weight, plan.act_bits, plan.act_outliers
        )
        setattr(parent, child, fake)
        fakes.append((plan, fake))
    params = [p for _, f in fakes for p in f.parameters()]
    optimizer = torch.optim.Adam(params, lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            for (args, kwargs), target, mask in zip(
                record.inputs, record.outputs, masks, strict=True
            ):
                optimizer.zero_grad(set_to_none=True)
                loss = _masked_mse(_hidden(block(*args, **kwargs)), target, mask)
                loss.backward()
                optimizer.step()
    for plan, fake in fakes:
        parent, child = get_submodule_parent(model, plan.name)
        setattr(parent, child, make_quant_linear(fake.to_linear(), plan))
