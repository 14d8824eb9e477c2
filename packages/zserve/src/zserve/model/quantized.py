"""Serving a zquant directory (the output of `z quantize`) in zserve's LLaMA model.

A zquant directory (`zquant.json` beside `model.safetensors` and `config.json`, see
`zquant.serialize`) stores every quantized linear layer in its packed form (`<layer>.qdata`,
`.qscale`, ... and `.qmeta`) and every other tensor as it was. `QuantizedLinears` reads it
(the manifest and the SHA-256 of the weights are checked by zquant's own reader) and hands
`LlamaModel` one callable per fused projection (q/k/v, o, gate/up, down):

- quantized layers run as zquant's own modules (`zquant.nn.QuantLinear`, or
  `OutlierQuantLinear` where the recipe keeps activation outlier channels), with the
  native backend (each called through `zserve.model.quantized_bound.BoundLinear`, which
  takes the numpy views of its packed buffers once, not on every call), so that
  - W8A8 (INT8 symmetric per channel/tensor, INT8 token-wise activations) goes through
    `znative.int8_linear`: the activation quantization is fused into the INT8 GEMM, and for
    a decode step's few rows (`zquant.nn.FUSED_OUTLIER_MAX_ROWS`) so is the recipe's
    outlier-channel split (one kernel call per projection instead of ~10 torch ops);
  - INT3/INT4 (W4, and W4A8's MLP, whose activations are quantized token-wise first) and FP6
    weights go through `znative.dequant_linear`, which dequantizes weight tiles in cache inside
    the GEMM: the whole weight is never dequantized per call.

  Parts of one projection with the same spec and per-row scales (q/k/v, gate/up) are fused
  into one packed weight by concatenating their rows (the packed layouts are row-major, so
  this is exact); otherwise their outputs are concatenated.
- the LM head, when the recipe quantized it (`z quantize --lm-head int8`: INT8 per row, INT8
  token-wise activations), is its own W8A8 zquant module on `znative.int8_linear`
  (`QuantizedLinears.head`) beside the full-precision embedding table, which the input
  lookup keeps reading: a lookup reads a few rows, while the head reads all 49152 x 576
  of SmolLM2's every decode step (113 MB in fp32, 28 MB in INT8);
- layers the recipe kept in full precision (`skip`/`keep`, e.g. the tied `lm_head` by
  default) are read as plain tensors; `fallback` lists them with the dtype the directory stores them in (a
  bf16/fp16 tensor widens exactly to an fp32 engine).
- a pruned model (`zquant.redundancy_clean` before quantizing) keeps its smaller MLP widths:
  each layer's width is read from its stored `up_proj`. Pruned attention heads are refused:
  the paged KV cache gives every layer the head count of `config.json`.

Anything else is a `QuantizedModelError` naming the layer and what to do: a format the
native kernels do not run (INT8 weight-only, binary/ternary, INT5-7; serving those would
dequantize the whole weight on every call), an encoder manifest, or a device other than
the CPU (the kernels are CPU kernels). `zserve` never falls back to fp32 silently.

Compared with `z eval` of the same directory (transformers' model with the same zquant
modules, torch backend), the served model runs the same numbers through other kernels:
`tests/zserve/test_quantized_serving.py` states the perplexity tolerance.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from zquant.nn import QuantLinear
    from zquant.quantizers import QuantizedWeight

MANIFEST = "zquant.json"
"""The manifest's file name (`zquant.serialize.MANIFEST`), here so detecting a directory
needs no zquant."""

HEAD = "lm_head"
"""The LM head's layer name in a LLaMA-family directory (`zquant.schemes.HEAD_PATTERNS`)."""

Linear = Callable[[torch.Tensor], torch.Tensor]
"""A projection ``(T, in) -> (T, out)``."""

#: Loads a plain checkpoint tensor by name, checked to have the given shape.
TensorLoader = Callable[..., torch.Tensor]


class QuantizedModelError(ValueError):
    """A zquant directory zserve cannot serve as it is (the message names the layer and fix)."""


def is_zquant_dir(model_dir: str | os.PathLike[str]) -> bool:
    """Whether `model_dir` was written by `z quantize` / `zquant.save_quantized`."""
    return (Path(model_dir) / MANIFEST).is_file()


@dataclass
class DenseLinear:
    """A full-precision projection: ``x W^T + b`` (a kept layer inside a quantized model)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class ConcatLinear:
    """Parts that cannot share one packed weight, run one by one; outputs concatenated."""

    parts: list[Linear]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _zquant_modules() -> tuple[Any, Any, Any]:
    """zquant's `nn`, `native` and `serialize` modules (the optional `quant` extra)."""
    try:
        from zquant import native, nn, serialize
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "serving a zquant directory needs zquant; install zserve's `quant` extra "
            "(`pip install 'zserve[quant]'`)"
        ) from exc
    return nn, native, serialize


def _servable(layer: QuantLinear, native: Any) -> str | None:
    """The kernel that serves `layer`, or None when no native kernel runs its format."""
    if layer.path == "w8a8":
        return "int8_linear"
    if native.supports(layer.quantized_weight()):
        return "dequant_linear"
    return None


@dataclass
class QuantizedLinears:
    """The quantized linear layers of a zquant directory, served through zquant's modules."""

    model_dir: Path
    manifest: dict[str, Any]
    state: dict[str, torch.Tensor]
    served: dict[str, str] = field(default_factory=dict)
    """Quantized layers built so far: name -> ``"<spec>, a<bits> -> <native kernel>"``."""
    fallback: dict[str, torch.dtype] = field(default_factory=dict)
    """Linear layers served in full precision (the recipe's skip/keep): name -> stored dtype."""

    @classmethod
    def open(cls, model_dir: str | os.PathLike[str], device: torch.device) -> QuantizedLinears:
        """Read and check `model_dir`'s manifest and weights (zquant's reader: a missing or
        altered file fails naming it)."""
        _, _, serialize = _zquant_modules()
        model_dir = Path(model_dir)
        if device.type != "cpu":
            raise QuantizedModelError(
                f"`{model_dir}` is a zquant directory, served with the native CPU kernels "
                f"(INT8 GEMM, dequantize-GEMM); device {str(device)!r} is not supported: "
                "serve it with device='cpu'"
            )
        manifest = serialize.read_manifest(model_dir)
        if manifest.get("kind") not in (None, "causal"):
            raise QuantizedModelError(
                f"`{model_dir / MANIFEST}` holds a {manifest.get('kind')!r} model; zserve serves "
                "causal LMs (quantize a LLaMA-family decoder)"
            )
        if not isinstance(manifest.get("layers"), dict):
            raise QuantizedModelError(
                f"`{model_dir / MANIFEST}` has no `layers` object; re-run `z quantize`"
            )
        return cls(model_dir, manifest, serialize.load_state(model_dir, manifest))

    @property
    def layers(self) -> dict[str, Any]:
        """The manifest's quantized layers: name -> {weight spec, act_bits, act_outliers}."""
        layers: dict[str, Any] = self.manifest["layers"]
        return layers

    def check_plain(self, name: str) -> None:
        """Refuse to read a quantized layer's weight as a plain tensor (e.g. Mixtral experts,
        which zserve runs as grouped GEMMs of full-precision weights)."""
        layer = name.removesuffix(".weight")
        if layer != name and layer in self.layers:
            raise QuantizedModelError(
                f"layer {layer!r} of `{self.model_dir}` is quantized "
                f"({self.layers[layer].get('weight')}), but zserve reads it as a full-precision "
                f"tensor (`{name}`); re-quantize with `z quantize --skip '{layer}'`"
            )

    def out_features(self, prefix: str, default: int) -> int:
        """Rows of the layer `prefix` as stored (pruned layers are smaller than config.json
        says); `default` when the directory does not hold it."""
        if prefix in self.layers and prefix + ".qmeta" in self.state:
            return int(self.state[prefix + ".qmeta"][6])
        weight = self.state.get(prefix + ".weight")
        return default if weight is None else int(weight.shape[0])

    def linear(
        self,
        prefixes: list[str],
        rows: list[int],
        cols: int,
        bias: bool,
        plain: TensorLoader,
    ) -> Linear:
        """One projection over the layers `prefixes` (outputs concatenated in that order),
        each ``(rows[i], cols)``; `plain(name, *shape)` loads a full-precision tensor."""
        parts: list[Linear] = []
        quantized: list[QuantLinear] = []
        for prefix, out in zip(prefixes, rows, strict=True):
            if prefix in self.layers:
                quantized.append(self._layer(prefix, out, cols))
                parts.append(quantized[-1])
            else:
                w = plain(prefix + ".weight", out, cols)
                self.fallback[prefix] = self.state[prefix + ".weight"].dtype
                b = plain(prefix + ".bias", out) if bias else None
                parts.append(DenseLinear(w, b))
        if len(quantized) == len(parts) > 1:
            fused = self._fuse(quantized, ",".join(prefixes))
            if fused is not None:
                return _bound(fused)
        if not quantized:  # all full precision: one matrix, as for a plain checkpoint
            dense = [p for p in parts if isinstance(p, DenseLinear)]
            w = torch.cat([d.weight for d in dense])
            b = torch.cat([d.bias for d in dense if d.bias is not None]) if bias else None
            return DenseLinear(w, b)
        parts = [p if isinstance(p, DenseLinear) else _bound(p) for p in parts]
        return parts[0] if len(parts) == 1 else ConcatLinear(parts)

    def head(self, vocab: int, hidden: int) -> Linear | None:
        """The quantized LM head ``(T, hidden) -> (T, vocab)`` on the INT8 GEMM, or None when
        the directory keeps the head in full precision (the tied embedding or
        ``lm_head.weight``, read as plain tensors)."""
        return _bound(self._layer(HEAD, vocab, hidden)) if HEAD in self.layers else None

    def _layer(self, name: str, rows: int, cols: int) -> QuantLinear:
        """zquant's module for the quantized layer `name`, native kernels on."""
        nn, native, _ = _zquant_modules()
        prefix = name + "."
        sub = {k[len(prefix) :]: v for k, v in self.state.items() if k.startswith(prefix)}
        if "qmeta" not in sub:
            raise QuantizedModelError(
                f"`{self.model_dir / 'model.safetensors'}` has no packed tensors for quantized "
                f"layer {name!r}; the file does not belong to this manifest, re-run `z quantize`"
            )
        if "qoutliers" in sub:
            layer = nn.OutlierQuantLinear.from_state(sub, name=name)
            layer.set_outliers(int(sub["qoutliers"]))
        else:
            layer = nn.QuantLinear.from_state(sub, name=name)
        if (layer.out_features, layer.in_features) != (rows, cols):
            heads = ".self_attn." in name
            raise QuantizedModelError(
                f"quantized layer {name!r} is {(layer.out_features, layer.in_features)}, but "
                f"config.json implies {(rows, cols)}"
                + (
                    "; head-pruned models are not served (the paged KV cache takes every "
                    "layer's head count from config.json): prune MLP rows/channels only"
                    if heads
                    else "; does config.json belong to these weights? re-run `z quantize`"
                )
            )
        kernel = _servable(layer, native)
        if kernel is None:
            act = f"a{layer.act_bits}" if layer.act_bits else "weight-only"
            raise QuantizedModelError(
                f"quantized layer {name!r} is {layer.spec.describe()} {act}: no native kernel "
                "serves it without dequantizing the whole weight on every call. zserve serves "
                "W8A8 (int8 sym channel/tensor + 8-bit activations), INT3/INT4 and FP6 weights "
                "(recipes w8a8, w4a8, w4, w6a16); re-quantize with one of them, or keep the "
                f"layer in full precision (`z quantize --skip '{name}'`)"
            )
        layer.backend = "native"
        act = f"a{layer.act_bits}" if layer.act_bits else "weight-only"
        self.served[name] = f"{layer.spec.describe()} {act} -> {kernel}"
        return layer

    def _fuse(self, layers: list[QuantLinear], name: str) -> QuantLinear | None:
        """One zquant module over the rows of `layers` (same spec, activation bits, outlier
        count and per-row scales), or None when they cannot share a packed weight."""
        first = layers[0]
        outliers = [getattr(layer, "act_outliers", 0) for layer in layers]
        same = all(
            layer.spec == first.spec
            and layer.act_bits == first.act_bits
            and layer.in_features == first.in_features
            and type(layer) is type(first)
            and layer.qscale.shape[0] == layer.out_features  # per-row, not per-tensor, scales
            for layer in layers
        )
        if not same or len(set(outliers)) != 1:
            return None
        qws = [layer.quantized_weight() for layer in layers]
        fused_qw = _cat_rows(qws)
        biases = [layer.bias for layer in layers]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            return None
        bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        cls = type(first)
        fused = cls(fused_qw, bias, first.act_bits, name=name)
        if outliers[0]:
            fused.set_outliers(outliers[0])
        fused.backend = "native"
        return fused  # type: ignore[no-any-return]


def _bound(layer: Any) -> Linear:
    """`layer` with its kernel arguments bound once (:mod:`zserve.model.quantized_bound`)."""
    from zserve.model.quantized_bound import bind

    return bind(layer)


def _cat_rows(qws: list[QuantizedWeight]) -> QuantizedWeight:
    """The packed weights `qws` stacked along the output rows (row-major layouts: exact)."""
    from zquant.quantizers import QuantizedWeight

    def cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if parts[0] is None else torch.cat([p for p in parts if p is not None])

    data = cat([q.data for q in qws])
    scale = cat([q.scale for q in qws])
    assert data is not None and scale is not None
    return QuantizedWeight(
        qws[0].spec,
        (sum(q.shape[0] for q in qws), qws[0].shape[1]),
        data,
        scale,
        cat([q.zero for q in qws]),
        cat([q.data2 for q in qws]),
    )
