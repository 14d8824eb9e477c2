"""Latency of quantized linears against fp32 ``torch.nn.functional.linear``, same run.

Used by ``benchmarks/quant.py`` (``z bench quant``). For each ``(in, out)`` shape,
each batch size and each quantization setting, the fp32 baseline and the
quantized layer are timed in interleaved rounds (one call of each per round, so
both share whatever else the machine is doing) and the medians are compared.

Run alone: ``python benchmarks/_quant_latency.py`` prints the JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from zquant.nn import QuantLinear
from zquant.quantizers import QuantSpec

#: name -> (weight spec, activation bits, ``QuantLinear.backend``): ``auto`` is what
#: a layer uses by default; ``native`` forces the fused znative kernels.
DEFAULT_SPECS: dict[str, tuple[QuantSpec, int | None, str]] = {
    "w8a8": (QuantSpec(8), 8, "auto"),
    "w8a8-native": (QuantSpec(8), 8, "native"),
    "w8": (QuantSpec(8), None, "auto"),
    "w4-g128": (QuantSpec(4, granularity="group", group_size=128), None, "auto"),
    "w4-g128-fused": (QuantSpec(4, granularity="group", group_size=128), None, "native"),
    "fp6": (QuantSpec(6, "fp6"), None, "auto"),
    "fp6-fused": (QuantSpec(6, "fp6"), None, "native"),
}
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((576, 1536), (1536, 576), (384, 1536))
DEFAULT_BATCHES: tuple[int, ...] = (1, 16, 64, 256)


def _median_pair(a: Callable[[], Any], b: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b`` timed alternately (after two warm-up calls each)."""
    for _ in range(2):
        a()
        b()
    ta, tb = [], []
    for r in range(repeats):
        first, second, out_first, out_second = (a, b, ta, tb) if r % 2 == 0 else (b, a, tb, ta)
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        t2 = time.perf_counter()
        out_first.append(t1 - t0)
        out_second.append(t2 - t1)
    return statistics.median(ta), statistics.median(tb)


def _layer(
    linear: torch.nn.Linear, spec: QuantSpec, act_bits: int | None, backend: str
) -> QuantLinear:
    layer = QuantLinear.from_linear(linear, spec, act_bits, name="bench")
    layer.backend = backend  # type: ignore[assignment]
    return layer


def measure_linear_latency(
    in_features: int,
    out_features: int,
    batch_sizes: Sequence[int] = DEFAULT_BATCHES,
    specs: dict[str, tuple[QuantSpec, int | None, str]] | None = None,
    repeats: int = 30,
    seed: int = 0,
) -> dict[str, Any]:
    """Times every spec against fp32 ``F.linear`` on an ``(out, in)`` layer.

    Returns ``{"in_features", "out_features", "rows": [{"spec", "batch", "fp32_ms",
    "quant_ms", "speedup", "max_abs_err", "weight_bytes", "fp32_weight_bytes"}]}``;
    ``speedup`` is ``fp32_ms / quant_ms`` (> 1 means the quantized layer is faster).
    """
    specs = DEFAULT_SPECS if specs is None else specs
    g = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g) * in_features**-0.5)
        linear.bias.copy_(torch.randn(out_features, generator=g) * 0.02)
    rows = []
    for name, (spec, act_bits, backend) in specs.items():
        layer = _layer(linear, spec, act_bits, backend)
        for batch in batch_sizes:
            x = torch.randn(batch, in_features, generator=g)
            with torch.no_grad():
                ref = F.linear(x, linear.weight, linear.bias)
                err = float((layer(x) - ref).abs().max())
                fp32_s, quant_s = _median_pair(
                    lambda x=x: F.linear(x, linear.weight, linear.bias),
                    lambda x=x, layer=layer: layer(x),
                    repeats,
                )
            rows.append(
                {
                    "spec": name,
                    "weight": spec.describe(),
                    "act_bits": act_bits,
                    "backend": backend,
                    "batch": batch,
                    "fp32_ms": round(fp32_s * 1e3, 4),
                    "quant_ms": round(quant_s * 1e3, 4),
                    "speedup": round(fp32_s / quant_s, 3),
                    "max_abs_err": err,
                    "weight_bytes": layer.nbytes(),
                    "fp32_weight_bytes": (linear.weight.numel() + linear.bias.numel()) * 4,
                }
            )
    return {"in_features": in_features, "out_features": out_features, "rows": rows}


def run_all(
    shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
    batch_sizes: Sequence[int] = DEFAULT_BATCHES,
    repeats: int = 30,
    threads: int | None = 2,
) -> dict[str, Any]:
    """:func:`measure_linear_latency` over several shapes, with the thread count recorded."""
    if threads:
        torch.set_num_threads(threads)
    return {
        "torch_threads": torch.get_num_threads(),
        "cpu": os.cpu_count(),
        "shapes": [measure_linear_latency(i, o, batch_sizes, repeats=repeats) for i, o in shapes],
    }


def report(result: dict[str, Any]) -> str:
    """Human-readable table of :func:`run_all` output."""
    lines = [
        f"{'shape':>11} {'spec':>15} {'batch':>5} {'fp32 ms':>9} {'quant ms':>9} {'speedup':>8}"
    ]
    for shape in result["shapes"]:
        dims = f"{shape['in_features']}x{shape['out_features']}"
        for r in shape["rows"]:
            lines.append(
                f"{dims:>11} {r['spec']:>15} {r['batch']:>5} {r['fp32_ms']:>9.3f} {r['quant_ms']:>9.3f} "
                f"{r['speedup']:>7.2f}x"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    out = run_all()
    print(report(out))
    print(json.dumps(out))
