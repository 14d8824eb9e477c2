"""Linear-activation-Linear experts over contiguous row slices: the two fast paths.

``sliced_mlp`` (CPU): one autograd node for all experts. Forward runs expert by expert on
its own rows (``addmm``, the activation, ``addmm`` written straight into the output), and
backward does the same in reverse, so each expert's ``[rows, ffn]`` activation is produced
and consumed while it is still in cache, and no stacked weights, ``cat`` or per-expert
autograd nodes are built. Profiled on a 2-core CPU (T=4096, d=256, ffn=1024, 8 experts,
top-2, fp32), ``torch._grouped_mm`` was a loop of ``mm`` plus copies: the weights stacked
and transposed every call, the biases expanded to ``[R, ffn]`` with ``repeat_interleave``
(a 32 MB add forward and a scatter-add backward), and the output concatenated.

``grouped_mlp`` (CUDA): two ``torch._grouped_mm`` over every slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: Row-wise activations the fused paths may apply to all experts' rows at once.
ROWWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)


def is_linear_act_linear(expert: nn.Module) -> bool:
    if not isinstance(expert, nn.Sequential) or len(expert) != 3:
        return False
    first, act, second = expert
    return (
        isinstance(first, nn.Linear)
        and isinstance(second, nn.Linear)
        and type(act) in ROWWISE
        and (first.bias is None) == (second.bias is None)
    )


def _act(act: nn.Module, pre: Tensor) -> Tensor:
    """The activation, out of place (an ``inplace=True`` SiLU/ReLU would clobber ``pre``)."""
    if isinstance(act, nn.GELU):
        return F.gelu(pre, approximate=act.approximate)
    if isinstance(act, nn.ReLU):
        return F.relu(pre)
    if isinstance(act, nn.SiLU):
        return F.silu(pre)
    if isinstance(act, nn.Tanh):
        return torch.tanh(pre)
    if isinstance(act, nn.Sigmoid):
        return torch.sigmoid(pre)
    return pre


def _act_backward(act: nn.Module, grad: Tensor, pre: Tensor, h: Tensor) -> Tensor:
    """d loss / d pre from d loss / d h (``h = act(pre)``)."""
    if isinstance(act, nn.GELU):
        return torch.ops.aten.gelu_backward(grad, pre, approximate=act.approximate)
    if isinstance(act, nn.ReLU):
        return torch.ops.aten.threshold_backward(grad, h, 0)
    if isinstance(act, nn.SiLU):
        return torch.ops.aten.silu_backward(grad, pre)
    if isinstance(act, nn.Tanh):
        return torch.ops.aten.tanh_backward(grad, h)
    if isinstance(act, nn.Sigmoid):
        return torch.ops.aten.sigmoid_backward(grad, h)
    return grad


def _linear_into(out: Tensor, x: Tensor, w: Tensor, b: Tensor | None) -> None:
    if b is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(b, x, w.t(), out=out)


class _SlicedMLP(torch.autograd.Function):
    """``y[slice e] = act(x[slice e] @ w1_e.T + b1_e) @ w2_e.T + b2_e`` for every expert."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, counts: list[int], act: nn.Module, has_bias: bool, *params: Tensor
    ) -> Tensor:
        x = x.contiguous()
        ffn = params[0].shape[0]
        pre = x.new_empty(x.shape[0], ffn)  # [R, ffn] before the activation
        y = x.new_empty(x.shape[0], _unpack(params, 0, has_bias)[2].shape[0])  # [R, d]
        hs: list[Tensor] = []
        start = 0
        for e, rows in enumerate(counts):
            w1, b1, w2, b2 = _unpack(params, e, has_bias)
            end = start + rows
            if rows:
                _linear_into(pre[start:end], x[start:end], w1, b1)
                h = _act(act, pre[start:end])
                _linear_into(y[start:end], h, w2, b2)
                hs.append(h)
            else:
                hs.append(pre[start:end])
            start = end
        ctx.counts, ctx.act, ctx.has_bias, ctx.hs = counts, act, has_bias, hs
        ctx.save_for_backward(x, pre, *params)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, pre, *params = ctx.saved_tensors
        grad = grad.contiguous()  # [R, d]
        want_x = ctx.needs_input_grad[0]
        want_w = any(ctx.needs_input_grad[4:])
        gx = torch.empty_like(x) if want_x else None
        grads: list[Tensor | None] = []
        start = 0
        for e, rows in enumerate(ctx.counts):
            w1, b1, w2, b2 = _unpack(params, e, ctx.has_bias)
            end = start + rows
            g, p, h = grad[start:end], pre[start:end], ctx.hs[e]
            gpre = _act_backward(ctx.act, g @ w2, p, h)  # [rows, ffn]
            if gx is not None:
                torch.mm(gpre, w1, out=gx[start:end])
            if want_w:
                grads += [gpre.t() @ x[start:end]]
                grads += [gpre.sum(0)] if b1 is not None else []
                grads += [g.t() @ h]
                grads += [g.sum(0)] if b2 is not None else []
            start = end
        if not want_w:
            grads = [None] * len(params)
        ctx.hs = None
        return (gx, None, None, None, *grads)


def _unpack(
    params: tuple[Tensor, ...] | list[Tensor], e: int, has_bias: bool
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    if has_bias:
        w1, b1, w2, b2 = params[4 * e : 4 * e + 4]
        return w1, b1, w2, b2
    w1, w2 = params[2 * e : 2 * e + 2]
    return w1, None, w2, None


def sliced_mlp(experts: list[nn.Module], x: Tensor, counts: list[int]) -> Tensor:
    """[R, d]: Linear-act-Linear expert ``i`` on the ``counts[i]`` rows of its slice of ``x``."""
    has_bias = experts[0][0].bias is not None
    return _SlicedMLP.apply(x, counts, experts[0][1], has_bias, *_flat(experts, has_bias))


class _BatchedMLP(torch.autograd.Function):
    """``y[e] = act(x[e] @ w1_e.T + b1_e) @ w2_e.T + b2_e`` for the ``[E, S, d]`` buffer."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, act: nn.Module, has_bias: bool, *params: Tensor
    ) -> Tensor:
        per = 4 if has_bias else 2
        w1 = torch.stack(params[0::per])  # [E, ffn, d]
        w2 = torch.stack(params[2 if has_bias else 1 :: per])  # [E, d, ffn]
        if has_bias:
            b1, b2 = torch.stack(params[1::per]), torch.stack(params[3::per])
            pre = torch.baddbmm(b1.unsqueeze(1), x, w1.mT)  # [E, S, ffn]
            h = _act(act, pre)
            y = torch.baddbmm(b2.unsqueeze(1), h, w2.mT)
        else:
            pre = torch.bmm(x, w1.mT)
            h = _act(act, pre)
            y = torch.bmm(h, w2.mT)
        ctx.act, ctx.has_bias = act, has_bias
        ctx.save_for_backward(x, pre, h, w1, w2)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, pre, h, w1, w2 = ctx.saved_tensors
        grad = grad.contiguous()  # [E, S, d]
        gpre = _act_backward(ctx.act, torch.bmm(grad, w2), pre, h)  # [E, S, ffn]
        gx = torch.bmm(gpre, w1) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[3:]):
            return (gx, None, None, *([None] * (len(ctx.needs_input_grad) - 3)))
        parts = [torch.bmm(gpre.mT, x).unbind(0)]  # [E, ffn, d]
        if ctx.has_bias:
            parts.append(gpre.sum(1).unbind(0))
        parts.append(torch.bmm(grad.mT, h).unbind(0))  # [E, d, ffn]
        if ctx.has_bias:
            parts.append(grad.sum(1).unbind(0))
        grads = [g for per_expert in zip(*parts, strict=True) for g in per_expert]
        return (gx, None, None, *grads)


def batched_mlp(experts: list[nn.Module], x: Tensor) -> Tensor:
    """[E, S, d] -> [E, S, d]: Linear-act-Linear expert ``e`` on row block ``e``."""
    has_bias = experts[0][0].bias is not None
    return _BatchedMLP.apply(x.contiguous(), experts[0][1], has_bias, *_flat(experts, has_bias))


def _flat(experts: list[nn.Module], has_bias: bool) -> list[Tensor]:
    params: list[Tensor] = []
    for expert in experts:
        first, second = expert[0], expert[2]
        if has_bias:
            params += [first.weight, first.bias, second.weight, second.bias]
        else:
            params += [first.weight, second.weight]
    return params


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (the grouped GEMM's backward
    refuses an expanded gradient such as ``out.sum()``'s)."""

    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


def grouped_mlp(experts: list[nn.Module], x: Tensor, counts: list[int]) -> Tensor:
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
