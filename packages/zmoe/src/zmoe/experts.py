"""This rank's experts, named by their global index so checkpoints do not depend on ``ep``.

``Experts`` is an ``nn.ModuleDict`` keyed by ``str(global_index)``: at ``ep_size=2`` with 8
experts, rank 1 holds keys ``"4"`` .. ``"7"``, so a parameter is ``experts.5.0.weight``
whatever the expert-parallel size, and a checkpoint holds one entry per expert.

Every expert parameter carries ``zero_axis = "edp"``: the ZeRO engine shards and reduces it
over the expert-data-parallel ranks (those holding the same experts), not over ``dp``.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

#: Row-wise activations the grouped-GEMM path may apply to all experts' rows at once.
ROWWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)

#: The public attribute naming the mesh axis a parameter's ZeRO partition spans.
ZERO_AXIS_ATTR = "zero_axis"
EXPERT_AXIS = "edp"


def _output(out: Tensor | tuple[Tensor, ...]) -> Tensor:
    return out[0] if isinstance(out, tuple) else out  # (output, bias) experts, as DeepSpeed


class Experts(nn.ModuleDict):
    """Deep copies of ``expert`` for global experts ``first .. first + count - 1``."""

    def __init__(self, expert: nn.Module, first: int, count: int) -> None:
        super().__init__({str(first + i): copy.deepcopy(expert) for i in range(count)})
        self.first = first
        for p in self.parameters():
            setattr(p, ZERO_AXIS_ATTR, EXPERT_AXIS)
        self.grouped = hasattr(torch, "_grouped_mm") and _is_linear_act_linear(expert)
        """Whether dropless slices run as two ``torch._grouped_mm`` (expert = Linear, a
        row-wise activation, Linear); turned off for good if the backend refuses it."""

    def run_slices(self, x: Tensor, counts: list[int]) -> Tensor:
        """[sum(counts), d]: expert ``i`` (local order) on the ``counts[i]`` rows of its slice.

        A Linear-activation-Linear expert runs as one grouped GEMM per layer over every slice
        (measured faster than a GEMM pair per expert on CPU); any other expert is its own
        module call on its slice, an empty slice not run.
        """
        if self.grouped and x.shape[0]:
            try:
                return _grouped(list(self.values()), x, counts)
            except RuntimeError:  # e.g. a dtype or device the grouped kernel does not take
                self.grouped = False
        outs = []
        for expert, chunk in zip(self.values(), x.split(counts), strict=True):
            outs.append(_output(expert(chunk)) if chunk.shape[0] else chunk)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def run_buffer(self, x: Tensor) -> Tensor:
        """[E_local, S, d] -> [E_local, S, d]: expert ``i`` on row block ``i`` (capacity path)."""
        local, slots, d = x.shape
        if self.grouped and slots:
            return self.run_slices(x.reshape(local * slots, d), [slots] * local).view(x.shape)
        return torch.stack(
            [_output(e(chunk)) for e, chunk in zip(self.values(), x.unbind(0), strict=True)]
        )


def _is_linear_act_linear(expert: nn.Module) -> bool:
    if not isinstance(expert, nn.Sequential) or len(expert) != 3:
        return False
    first, act, second = expert
    return (
        isinstance(first, nn.Linear)
        and isinstance(second, nn.Linear)
        and type(act) in ROWWISE
        and (first.bias is None) == (second.bias is None)
    )


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (the grouped GEMM's backward
    refuses an expanded gradient such as ``out.sum()``'s)."""

    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


def _grouped(experts: list[nn.Module], x: Tensor, counts: list[int]) -> Tensor:
    """Linear-act-Linear experts over their slices of ``x`` [R, d] with ``torch._grouped_mm``."""
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    sizes = torch.tensor(counts, device=x.device)
    first = [e[0] for e in experts]
    second = [e[2] for e in experts]
    w1 = torch.stack([m.weight for m in first]).transpose(1, 2).contiguous()  # [E, d, ffn]
    w2 = torch.stack([m.weight for m in second]).transpose(1, 2).contiguous()  # [E, ffn, d]
    h = torch._grouped_mm(x.contiguous(), w1, offs=offs)  # [R, ffn]
    if first[0].bias is not None:
        h = h + torch.stack([m.bias for m in first]).repeat_interleave(sizes, 0, output_size=len(x))
    h = experts[0][1](h)
    y = torch._grouped_mm(h, w2, offs=offs)
    if second[0].bias is not None:
        y = y + torch.stack([m.bias for m in second]).repeat_interleave(
            sizes, 0, output_size=len(x)
        )
    return _ContiguousGrad.apply(y)
