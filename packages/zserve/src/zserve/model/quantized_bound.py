"""A served zquant layer's native kernel call with its weight-side arguments bound once.

`zquant.nn.QuantLinear.forward` (backend ``native``) is the reference and what `z eval`
runs: per call it rebuilds the layer's `QuantizedWeight`, checks the backend and autograd,
converts every packed buffer with ``.detach().to(...).contiguous()`` and takes a numpy view
of each (`zquant.native`), then calls ``znative.int8_linear`` / ``znative.dequant_linear``.
A SmolLM2 decode step makes 121 such calls; that Python work was ~7 ms of a 20 ms W4 step
(one thread), as long as the INT8 head's GEMM and the attention together. `BoundLinear`
takes the numpy views of the weight, scales, zero points and bias once
(:meth:`BoundLinear.bind`) and per call only views the activations and the output: the
same kernel on the same arguments, so the output is bit-identical to the module's
(`tests/zserve/test_quantized_bound.py`, atol 0).

An INT4 layer's calls (every row count: decode steps, batches, prompts) quantize their
activations to INT8 per 32 columns in the kernel (``znative.dequant_linear(...,
act_bits=8)``, llama.cpp's Q8 activations; on AVX2 its ``vpmaddubsw`` bodies ran SmolLM2's
64-row products ~2x and its one-row products ~4x the float path, see
``benchmarks/results/serve-avx2.md``): not the module's numbers, but the product of the
activations rounded to their codes, each moved by at most half its block's scale (the bound
is `tests/zserve/test_quantized_bound.py`'s). Each row is rounded on its own and the
kernel's bodies for few and many rows give the same bits, so a request's numbers do not
depend on what shares its batch. A column cut would not be tensor-parallel invariant (a
rank's cut inside a 32-column block, or the all-reduce's last bits, moves some codes), so
tensor-parallel serving cuts such a layer's o/down by output rows over the gathered input
(:func:`a8_applies`, ``zserve.tp.quantized``). ``ZSERVE_W4_A8=0`` keeps every call on the
module's float path (``1``, the default, is the only other value).

It runs a call on the kernel when the module's native path would run the same kernel:
float32 2-D activations of at most `max_rows` rows, no autograd; otherwise (a bfloat16
engine's activations) it calls the module. An `OutlierQuantLinear`'s calls of more than
:attr:`BoundLinear.call_rows` rows (prompts) run the module's split as the module does, on
the bound views (the channel choice and the outlier term's sum stay torch's, so they stay
bit-equal to `z eval`; the column maxima are `znative.column_absmax`'s, exact): no torch op
there is large enough to need torch's threads, so such a layer counts as on the kernels at
every row count (``max_rows``), and a step of them runs torch single-threaded beside
znative's team (`LlamaModel.step_threads`: two torch threads spinning beside that team
made a 64-token W8A8 prompt 2-4x slower on 2 cores). Layers with their activations
fake-quantized (W4A8's MLP) stay modules (:func:`bind`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

import znative

if TYPE_CHECKING:
    from zquant.nn import QuantLinear

#: Rows of a call with no row limit (a layer without activation outliers).
NO_LIMIT = 1 << 62
#: ``ZSERVE_W4_A8``'s values: INT8 activations for INT4 layers on (the default) or off.
A8_VALUES = {"1": True, "0": False}


def _c(t: torch.Tensor, dtype: torch.dtype) -> Any:
    """A numpy view of ``t`` as a contiguous CPU tensor of ``dtype`` (`zquant.native`'s
    conversion; no copy when it already is one)."""
    return t.detach().to(device="cpu", dtype=dtype).contiguous().numpy()


class BoundLinear:
    """`layer`'s native forward ``(T, in) -> (T, out)`` with the weight arguments bound."""

    def __init__(self, layer: QuantLinear, max_rows: int, call_rows: int | None = None) -> None:
        self.layer = layer
        self.max_rows = max_rows
        """Rows up to which a call runs on znative (and torch ops too small for threads)."""
        self.call_rows = max_rows if call_rows is None else call_rows
        """Rows up to which a call is the one kernel call of :meth:`kernel_call`; larger
        ones (an outlier layer's prompts) are :meth:`_split`'s."""
        self.out_features = layer.out_features
        self._kernel: Any = None
        self._args: tuple[Any, ...] = ()
        self._kwargs: dict[str, Any] = {}
        self.bind()

    def bind(self) -> None:
        """(Re)take the numpy views of the layer's buffers: after they moved (e.g. onto huge
        pages, :func:`zserve.model.native.pack_on_huge_pages`)."""
        from zquant import native

        layer = self.layer
        bias = None if layer.bias is None else _c(layer.bias, torch.float32)
        if layer.path == "w8a8":
            scale = _c(layer.qscale.reshape(-1), torch.float32)
            self._kernel = znative.int8_linear
            self._args = (_c(layer.qdata, torch.int8), scale, bias)
            self._kwargs = {"outliers": int(getattr(layer, "act_outliers", 0))}
        else:
            args = native.packed_args(layer.quantized_weight())
            self._kernel = znative.dequant_linear
            self._args = (args.pop("data"), args.pop("scale"), bias)
            self._kwargs = {**args, "act_bits": 8} if a8_applies(layer) else args

    def unbind(self) -> None:
        """Let go of the views of the layer's buffers (they are about to move or be freed;
        :meth:`bind` takes them again). Calls in between fail."""
        self._kernel, self._args, self._kwargs = None, (), {}

    def kernel_call(self) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """``(kernel, args, kwargs)``: ``kernel(x, *args, out, **kwargs)`` is this layer's call
        on float32 ``x (T, in)`` of at most :attr:`call_rows` rows (valid until the next
        :meth:`bind`)."""
        w, scale, bias = self._args
        return self._kernel, (w, scale, bias), self._kwargs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if (
            x.dtype != torch.float32
            or x.dim() != 2
            or x.shape[1] != self.layer.in_features
            or not 0 < rows <= self.max_rows
            or (torch.is_grad_enabled() and x.requires_grad)
        ):
            return self.layer(x)  # type: ignore[no-any-return]
        x = x.contiguous()
        if rows > self.call_rows:
            return self._split(x)
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        w, scale, bias = self._args
        self._kernel(x.numpy(), w, scale, bias, out.numpy(), **self._kwargs)
        return out

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """`OutlierQuantLinear.forward`'s native split of ``x (T, in)`` (T above
        :attr:`call_rows`), the same ops on the bound views: bit-equal to the module."""
        rows, k = x.shape
        colmax = torch.empty(k, dtype=torch.float32)
        znative.column_absmax(x.numpy(), colmax.numpy())  # x.abs().amax(0), exact
        cols = colmax.topk(self._kwargs["outliers"]).indices
        t = cols.numel()
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        xo = torch.empty(rows, t, dtype=torch.float32)
        wc = torch.empty(self.out_features, t, dtype=torch.float32)
        w, scale, bias = self._args
        znative.int8_linear_split(
            x.numpy(), w, scale, bias, cols.numpy(), out.numpy(), xo.numpy(), wc.numpy()
        )
        return out.add_(xo @ wc.t())  # the module's `y + xo @ wc.t()`, in place

    def __getattr__(self, name: str) -> Any:
        """The layer's attributes (``in_features``, ``spec``, ``backend`` ...)."""
        if name == "layer":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.layer, name)

    def __repr__(self) -> str:
        return f"BoundLinear({self.layer!r}, max_rows={self.max_rows})"


def a8_applies(layer: QuantLinear) -> bool:
    """Whether ``layer``'s calls round their activations to INT8 per 32 columns (see the
    module doc): a weight-only INT4 layer on the native kernels whose input and groups are
    whole 32-column blocks, unless ``ZSERVE_W4_A8=0``. Tensor-parallel serving cuts such a
    layer's o/down by output rows over the gathered input (``zserve.tp.quantized``), as
    W8A8's, so tp=N keeps tp=1's numbers."""
    from zquant import native
    from zquant.quantizers import group_geometry

    if layer.path == "w8a8" or layer.act_bits is not None:
        return False
    qw = layer.quantized_weight()
    spec = qw.spec
    if not (native.supports(qw) and spec.fmt == "int" and 3 <= spec.bits <= 4):
        return False
    group, _ = group_geometry(spec, qw.shape[1])
    return layer.in_features % 32 == 0 and group % 32 == 0 and a8_enabled()


def a8_enabled() -> bool:
    """INT8 activations for INT4 layers are on: ``ZSERVE_W4_A8`` unset or ``1`` (``0``: off).

    Raises:
        ValueError: ``ZSERVE_W4_A8`` is set to another value.
    """
    value = os.environ.get("ZSERVE_W4_A8", "1")
    if value not in A8_VALUES:
        raise ValueError(
            f"ZSERVE_W4_A8={value!r} is not a setting: use 1 (INT4 layers' activations "
            "rounded to INT8, the default) or 0 (the float dequantize path), or unset it"
        )
    return A8_VALUES[value]


def bind(layer: QuantLinear) -> QuantLinear | BoundLinear:
    """`layer` (backend ``native``, CPU) as a :class:`BoundLinear` where its native forward
    is one kernel call on its stored buffers, else `layer` itself."""
    from zquant import native
    from zquant.nn import FUSED_OUTLIER_MAX_ROWS, OutlierQuantLinear

    if layer.backend != "native" or layer.qdata.device.type != "cpu":
        return layer
    outliers = isinstance(layer, OutlierQuantLinear) and layer.act_outliers > 0
    if layer.path == "w8a8":
        return BoundLinear(layer, NO_LIMIT, FUSED_OUTLIER_MAX_ROWS if outliers else None)
    if layer.act_bits is None and not outliers and native.supports(layer.quantized_weight()):
        return BoundLinear(layer, NO_LIMIT)
    return layer
