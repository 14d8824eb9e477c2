"""``QuantLinear``: an ``nn.Linear`` replacement that holds packed quantized weights.

Forward paths (chosen once at construction from the spec, see :attr:`QuantLinear.path`):

* ``"w8a8"``: INT8 symmetric per-channel/per-tensor weights with INT8 token-wise
  activations. The matmul runs in INT8 with int32 accumulation (``torch._int_mm``
  -> oneDNN VNNI on x86, or the native ``znative.int8_linear`` kernel, see
  :func:`default_backend`); the int32 result is scaled
  by ``activation scale (per token) x weight scale (per channel)``.
* ``"dequant"``: every other weight (INT8/INT4 group-wise, FP6, binary,
  ternary): the packed weight is dequantized into float32 and multiplied
  (``F.linear``, or the native fused dequantize-and-multiply kernel for small
  batches where it is faster). With ``act_bits`` set, activations are
  fake-quantized per token first (W4A8 emulation: the numbers of a W4A8 kernel,
  the speed of a weight-only one).

`OutlierQuantLinear` keeps the few largest activation channels of each call out of the
token-wise activation quantization (LLM.int8()'s decomposition; the `a8` recipes use it).

The module's buffers are the packed form (``state_dict()`` holds ``qdata``,
``qscale`` ...; see :meth:`zquant.quantizers.QuantizedWeight.to_state`), so a
saved model is the compressed model.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zquant import native
from zquant.quantizers import (
    QuantizedWeight,
    QuantSpec,
    dequantize_weight,
    fake_quantize_activation,
    quantize_activation_tokenwise,
    quantize_weight,
)

Backend = Literal["auto", "torch", "native"]
_STATE_KEYS = ("qmeta", "qdata", "qscale", "qzero", "qdata2")


def default_backend() -> Backend:
    """Backend of new layers: ``ZQUANT_BACKEND=auto|torch|native``, default ``auto``.

    ``auto`` is the fastest measured on the reference CPU (``benchmarks/_quant_latency.py``):
    W8A8 through ``torch._int_mm`` (oneDNN VNNI; the native VNNI kernel is within ~2x of it but
    not faster), INT3/INT4/FP6 weight-only through the native dequantize kernel + ``F.linear``
    (MKL), INT8/binary/ternary weight-only through the torch dequantize + ``F.linear``.
    ``torch`` uses only the torch reference; ``native`` uses the native fused kernels
    (``znative.int8_linear``, ``znative.dequant_linear``) wherever they apply.
    """
    value = os.environ.get("ZQUANT_BACKEND", "auto").strip().lower()
    if value not in ("auto", "torch", "native"):
        raise ValueError(f"ZQUANT_BACKEND={value!r} is unknown; use `auto`, `torch` or `native`")
    return value  # type: ignore[return-value]


def _is_w8a8(spec: QuantSpec, act_bits: int | None) -> bool:
    return (
        act_bits == 8
        and spec.fmt == "int"
        and spec.bits == 8
        and spec.symmetric
        and spec.granularity in ("channel", "tensor")
    )


class QuantLinear(nn.Module):
    """A linear layer ``y = x W^T + b`` whose ``W`` is stored quantized and packed."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: Tensor | None = None,
        act_bits: int | None = None,
        *,
        name: str = "",
    ) -> None:
        super().__init__()
        if act_bits is not None and not (isinstance(act_bits, int) and 2 <= act_bits <= 8):
            raise ValueError(
                f"layer {name!r} (weight shape {weight.shape}): act_bits={act_bits!r} is out of range; "
                "use 8 (W8A8), 2..7, or None for weight-only"
            )
        self.out_features, self.in_features = weight.shape
        self.spec = weight.spec
        self.act_bits = act_bits
        self.name = name
        for key, value in weight.to_state().items():
            self.register_buffer(key, value)
        self.register_buffer("qact", torch.tensor(act_bits or 0, dtype=torch.int64))
        # Frozen: the quantized layer is for inference; tune biases before quantizing (LKD).
        self.bias = (
            None
            if bias is None
            else nn.Parameter(bias.detach().to(torch.float32).clone(), requires_grad=False)
        )
        self.path: Literal["w8a8", "dequant"] = (
            "w8a8" if _is_w8a8(weight.spec, act_bits) else "dequant"
        )
        self.backend: Backend = default_backend()
        """Which kernels run the forward (see :func:`default_backend`); settable per layer."""

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        weight: QuantSpec,
        act_bits: int | None = None,
        *,
        name: str = "",
    ) -> QuantLinear:
        """Quantizes ``linear.weight`` with ``weight`` (``act_bits=8`` for W8A8)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"layer {name!r}: expected nn.Linear, got {type(linear).__name__}")
        qw = quantize_weight(linear.weight.detach(), weight, layer=name)
        return cls(qw, linear.bias, act_bits, name=name)

    @classmethod
    def from_state(cls, state: dict[str, Tensor], *, name: str = "") -> QuantLinear:
        """Rebuilds a layer from its own ``state_dict()`` (keys without a module prefix)."""
        qw = QuantizedWeight.from_state({k: state[k] for k in _STATE_KEYS if k in state})
        act = int(state["qact"]) if "qact" in state else 0
        return cls(qw, state.get("bias"), act or None, name=name)

    def quantized_weight(self) -> QuantizedWeight:
        """The packed weight as a :class:`QuantizedWeight` (views of this module's buffers).

        Built from the layer's spec without re-reading ``qmeta``: this runs on every forward.
        """
        return QuantizedWeight(
            self.spec,
            (self.out_features, self.in_features),
            self.qdata,
            self.qscale,
            getattr(self, "qzero", None),
            getattr(self, "qdata2", None),
        )

    def dequantized_weight(self) -> Tensor:
        """float32 ``(out, in)`` reconstruction of the weight."""
        return dequantize_weight(self.quantized_weight())

    def nbytes(self) -> int:
        """Stored bytes of the weight (codes + scales + zeros) plus the bias."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.quantized_weight().nbytes() + bias

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"layer {self.name!r}: input has {x.shape[-1]} features, weight expects {self.in_features}"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.float32)
        if self.path == "w8a8":
            y = self._w8a8(x2)
        else:
            if self.act_bits is not None:
                x2 = fake_quantize_activation(x2, self.act_bits)
            y = self._dequant_linear(x2)
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def _native_ok(self, x2: Tensor, *, fused: bool) -> bool:
        """Native kernels run on CPU; the fused ones have no backward, so not while autograd records."""
        if self.backend == "torch" or x2.device.type != "cpu":
            return False
        grads = torch.is_grad_enabled() and (
            x2.requires_grad or (self.bias is not None and self.bias.requires_grad)
        )
        return not (fused and grads)

    def _w8a8(self, x2: Tensor) -> Tensor:
        if self.backend == "native" and self._native_ok(x2, fused=True):
            return native.int8_linear(x2, self.qdata, self.qscale.reshape(-1), self.bias)
        q, a_scale = quantize_activation_tokenwise(x2, 8)
        acc = torch._int_mm(q, self.qdata.t())  # (tokens, out) int32, exact
        y = acc.to(torch.float32) * (a_scale * self.qscale.reshape(1, -1))
        return y if self.bias is None else y + self.bias

    def _dequant_linear(self, x2: Tensor) -> Tensor:
        qw = self.quantized_weight()
        if self._native_ok(x2, fused=False) and native.supports(qw):
            if self.backend == "native" and self._native_ok(x2, fused=True):
                return native.dequant_linear(x2, qw, self.bias)
            return F.linear(x2, native.dequantize(qw), self.bias)
        return F.linear(x2, dequantize_weight(qw).to(x2.device), self.bias)

    def extra_repr(self) -> str:
        act = f"a{self.act_bits}" if self.act_bits else "weight-only"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"weight={self.spec.describe()}, {act}, path={self.path}"
        )


#: Calls of at most this many rows (decode steps) run :class:`OutlierQuantLinear`'s W8A8 split
#: as one native call (``backend="native"``): at batch 1 its ~10 torch ops cost as much as the
#: GEMM. Its float32 outlier term sums in another order than torch's matmul (last bits), so
#: larger calls (prompts, perplexity) keep the channel choice and that sum in torch
#: (``znative.int8_linear_split`` does the rest) and stay bit-identical to ``z eval``.
FUSED_OUTLIER_MAX_ROWS = 16


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

    def _weight_columns(self, cols: Tensor) -> Tensor:
        """Dequantized weight columns `cols` of a W8A8 layer, (out, k): the INT8 codes times
        the row scale."""
        return self.qdata.index_select(1, cols).to(torch.float32) * self.qscale.reshape(-1, 1)

    def forward(self, x: Tensor) -> Tensor:
        k = self.act_outliers
        if not k or self.act_bits is None:
            return super().forward(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.float32)  # (tokens, in)
        if (
            self.path == "w8a8"
            and self.backend == "native"
            and x2.shape[0] <= FUSED_OUTLIER_MAX_ROWS
            and x.shape[-1] == self.in_features
            and self._native_ok(x2, fused=True)
        ):
            # The whole split in one kernel call (a decode step's few rows).
            y = native.int8_linear(x2, self.qdata, self.qscale.reshape(-1), self.bias, outliers=k)
            return y.reshape(*lead, self.out_features).to(x.dtype)
        cols = x2.abs().amax(0).topk(k).indices  # (k,)
        if (
            self.path == "w8a8"
            and self.backend == "native"
            and x.shape[-1] == self.in_features
            and self._native_ok(x2, fused=True)
        ):
            # A prompt's rows: the INT8 part and both operands of the outlier term in one
            # kernel call (the five torch ops below it replaces cost about as much as the
            # GEMM); the channel choice (torch's topk orders ties its own way) and the term's
            # sum stay torch's, so the result is the torch path's to the bit.
            w_scale = self.qscale.reshape(-1)
            y, xo, wc = native.int8_linear_split(x2, self.qdata, w_scale, self.bias, cols)
            return (y + xo @ wc.t()).reshape(*lead, self.out_features).to(x.dtype)
        # index_select, not x2[:, cols]: advanced indexing's parallel kernel stalls for
        # milliseconds per call on a busy CPU (measured 15 ms for 8 columns while serving)
        outliers = x2.index_select(1, cols)  # (tokens, k)
        if self.path == "w8a8":
            y = super().forward(x2.index_fill(1, cols, 0.0))  # (tokens, out)
            y = y + outliers @ self._weight_columns(cols).t()
        else:
            # A weight-only kernel multiplies float inputs, so the decomposition is one GEMM:
            # fq(x with C zeroed) W^T + x_C W_C^T = (fq(x with C zeroed) + x_C) W^T, the
            # outlier columns put back as they are. No weight is dequantized whole per call.
            xq = fake_quantize_activation(x2.index_fill(1, cols, 0.0), self.act_bits)
            y = self._dequant_linear(xq.index_copy(1, cols, outliers))
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, act_outliers={self.act_outliers}"
