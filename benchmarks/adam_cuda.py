"""GPU Adam step on a transformer's parameter list: zcore's FusedAdamCUDA against torch's
fused and foreach Adam, and DeepSpeed's FusedAdam when it is importable, with the GPU's
copy bandwidth measured in the same run.

The parameters are a GPT's tensors (token embedding ``vocab x hidden`` and, per layer, the
q/k/v, output, and two MLP matrices with their biases and two LayerNorms: 12 tensors per
layer), so the per-tensor host work a real model costs is in the step, not one flat
buffer. Each contender owns its own parameter, gradient and state buffers (the GPU has the
room; page placement does not move a GPU kernel the way it moves a CPU one).

An Adam step reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg,
exp_avg_sq: 28 bytes per fp32 parameter. The ceiling is a device-to-device copy of the
same byte count (read + write counted), timed the same way. Two timings per contender,
in interleaved rounds (one of each per round, the order rotating), medians reported:

- ``step_ms``: one ``optimizer.step()`` between CUDA events after a synchronize, which
  is what a loop that waits on each step sees (host launch work included);
- ``stream_ms``: ``--burst`` steps queued back to back, over the count, which is the
  GPU-bound rate a training loop reaches when the host runs ahead (as it does behind a
  backward pass).

Needs a CUDA device; without one it is an error naming that (rc 2).

Run: ``z bench adam-cuda [--hidden 1024 --layers 24 --vocab 50304] --json``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

#: bytes one fp32 Adam step moves per parameter (read p, g, m, v; write p, m, v)
BYTES_PER_PARAM = 28


def gpt_shapes(hidden: int, layers: int, vocab: int) -> list[tuple[int, ...]]:
    """The parameter shapes of a GPT-2-style model (tied head): embedding, then per layer
    LayerNorm, fused qkv, attention output, LayerNorm, MLP up and down, each with biases."""
    h = hidden
    shapes: list[tuple[int, ...]] = [(vocab, h), (1024, h)]
    for _ in range(layers):
        shapes += [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,)]
        shapes += [(h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    return [*shapes, (h,), (h,)]


def _deepspeed_fused_adam() -> tuple[Callable[..., torch.optim.Optimizer] | None, str]:
    """DeepSpeed's FusedAdam if it imports and builds here (never a dependency)."""
    try:
        from deepspeed.ops.adam import FusedAdam  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or its op builder failing at import
        return None, f"not importable: {type(e).__name__}: {e}".splitlines()[0][:200]
    return FusedAdam, "ok"


def _params(shapes: list[tuple[int, ...]], seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device="cuda", generator=g))
        p.grad = torch.randn(s, device="cuda", generator=g) * 1e-2
        out.append(p)
    return out


def _time(fn: Callable[[], Any], reps: int) -> float:
    """Milliseconds per call of ``reps`` calls queued back to back, between CUDA events."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def run(
    hidden: int = 1024,
    layers: int = 24,
    vocab: int = 50304,
    rounds: int = 10,
    burst: int = 10,
    warmup: int = 2,
) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise ValueError("needs a CUDA device and none is visible; run it on a GPU machine")
    if min(hidden, layers, vocab, rounds, burst) < 1 or warmup < 0:
        raise ValueError("--hidden, --layers, --vocab, --rounds and --burst must be >= 1")
    from zcore.optim import FusedAdamCUDA

    shapes = gpt_shapes(hidden, layers, vocab)
    numel = sum(torch.Size(s).numel() for s in shapes)
    makers: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
        "zstack_fused_adam_cuda": lambda ps: FusedAdamCUDA(ps, lr=1e-4),
        "torch_adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-4, fused=True),
        "torch_adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-4, foreach=True),
    }
    ds, ds_status = _deepspeed_fused_adam()
    if ds is not None:
        makers["deepspeed_fused_adam"] = lambda ps: ds(ps, lr=1e-4, adam_w_mode=False)
    opts = {name: make(_params(shapes, seed=0)) for name, make in makers.items()}
    for opt in opts.values():  # states created, kernels compiled and cached
        for _ in range(max(warmup, 1)):
            opt.step()
    src = torch.empty(BYTES_PER_PARAM * numel // 8, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)  # copying it reads + writes 28 bytes per parameter
    contenders: dict[str, Callable[[], Any]] = {n: o.step for n, o in opts.items()}
    contenders["ceiling_copy"] = lambda: dst.copy_(src)
    step_ms: dict[str, list[float]] = {n: [] for n in contenders}
    stream_ms: dict[str, list[float]] = {n: [] for n in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step_ms[name].append(_time(contenders[name], 1))
            stream_ms[name].append(_time(contenders[name], burst))
    ceiling = statistics.median(stream_ms["ceiling_copy"])
    results = {}
    for name in opts:
        s, b = statistics.median(step_ms[name]), statistics.median(stream_ms[name])
        results[name] = {
            "step_ms": s,
            "stream_ms": b,
            "stream_gb_per_s": BYTES_PER_PARAM * numel / (b / 1e3) / 1e9,
            "fraction_of_ceiling": ceiling / b,
        }
    ours = results["zstack_fused_adam_cuda"]
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "numel": numel,
        "tensors": len(shapes),
        "model": {"hidden": hidden, "layers": layers, "vocab": vocab},
        "rounds": rounds,
        "burst": burst,
        "ceiling": {
            "kernel": "device-to-device copy of 28 bytes per parameter (read + write)",
            "stream_ms": ceiling,
            "gb_per_s": BYTES_PER_PARAM * numel / (ceiling / 1e3) / 1e9,
        },
        "results": results,
        "speedup_of_ours": {
            name: {
                "step": r["step_ms"] / ours["step_ms"],
                "stream": r["stream_ms"] / ours["stream_ms"],
            }
            for name, r in results.items()
            if name != "zstack_fused_adam_cuda"
        },
        "deepspeed_fused_adam": ds_status,
    }


def report(result: dict[str, Any]) -> str:
    """A table a person can read; the JSON follows it."""
    c = result["ceiling"]
    lines = [
        f"adam step on {result['device']}, {result['numel']:,} params in {result['tensors']} "
        f"tensors, medians of {result['rounds']} rounds (stream: {result['burst']} queued steps)",
        f"{'ceiling (copy)':<24} {'':>9}    {c['stream_ms']:9.3f} ms  {c['gb_per_s']:8.1f} GB/s",
    ]
    for name, r in result["results"].items():
        lines.append(
            f"{name:<24} {r['step_ms']:9.3f} ms {r['stream_ms']:9.3f} ms  "
            f"{r['stream_gb_per_s']:8.1f} GB/s  {r['fraction_of_ceiling'] * 100:5.1f}% of ceiling"
        )
    for name, s in result["speedup_of_ours"].items():
        lines.append(
            f"zstack speedup over {name}: step {s['step']:.3f}x, stream {s['stream']:.3f}x"
        )
    lines.append(f"deepspeed_fused_adam: {result['deepspeed_fused_adam']}")
    return "\n".join(lines)
