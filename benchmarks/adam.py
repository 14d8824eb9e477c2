"""CPU Adam step: zcore's CPUAdam against torch's fused and foreach Adam, and
DeepSpeedCPUAdam when it is importable, with the machine's memory-bandwidth
ceiling measured in the same run.

An Adam step is memory-bound: per parameter it reads param, grad, exp_avg,
exp_avg_sq and writes param, exp_avg, exp_avg_sq — 28 bytes with fp32 states,
20 with bf16 states. The ceiling is a stream kernel with the same 4-read /
3-write pattern on the same thread pool (``znative.stream_4r3w``), so
``fraction_of_ceiling`` says how close each step gets to the hardware. The probe
runs at paces 0, 1 and 2 (dependent square-root/divide pairs per vector; a bare
pass is not always the fastest way to stream on this CPU, see
``zkernels::stream``) and the fastest pace's median is the ceiling.

All optimizers are timed in interleaved rounds (one step of each per round, the
order rotating from round to round) so they share whatever else the machine is
doing; medians are reported. With ``--dtype bf16-states`` the probe also runs in
the bf16-state layout (20 bytes, on our bf16 states): the fp32 ceiling's time over
that one's is the most any bf16-state step can gain over an fp32-state step on
this machine (``bf16_states_ceiling.speedup_bound``).

Every contender, and the ceiling probe, works on the same parameter, gradient and
fp32 state buffers: which physical pages a 1.6 GB set of buffers lands on alone
moves a memory-bound step by up to ~10% here, so separate buffers per contender
would compare page placement, not kernels. (Each optimizer creates its state in
an untimed first step; its fp32 ``exp_avg`` / ``exp_avg_sq`` are then swapped for
the shared ones. bf16 states keep their own buffers.)

Run: ``z bench adam --numel 100000000 [--dtype fp32|bf16-states] --json``.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import znative
from zcore.optim import CPUAdam
from zcore.optim.functional import kernel_view as view

#: bytes moved per parameter by one Adam step (read p, g, m, v; write p, m, v)
BYTES_PER_PARAM = {"fp32": 28, "bf16-states": 20}
DTYPES = tuple(BYTES_PER_PARAM)
#: paces the ceiling probe runs at (its fastest sets the ceiling)
PACES = (0, 1, 2)


def _deepspeed_adam() -> tuple[Callable[..., torch.optim.Optimizer] | None, str]:
    """DeepSpeedCPUAdam if it imports and builds here (never a dependency)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or its op builder failing at import
        return None, f"not importable: {type(e).__name__}: {e}".splitlines()[0][:200]
    return DeepSpeedCPUAdam, "ok"


class _Shared:
    """The buffers every contender steps on: one parameter with its gradient, and
    fp32 ``exp_avg`` / ``exp_avg_sq`` swapped into each optimizer's state."""

    def __init__(self, numel: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.param = torch.nn.Parameter(torch.randn(numel, generator=g))
        # Non-negative gradients keep exp_avg_sq >= 0 under the ceiling probe's
        # update (exp_avg_sq <- exp_avg_sq / 2 + grad), so every value stays finite.
        self.param.grad = (torch.randn(numel, generator=g) * 1e-2).abs_()
        self.state = {k: torch.zeros(numel) for k in ("exp_avg", "exp_avg_sq")}

    def adopt(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Create `opt`'s state with one untimed step, then point its fp32 moments at
        the shared buffers (its own are freed)."""
        opt.step()
        state = opt.state[self.param]
        for key, shared in self.state.items():
            mine = state.get(key)
            if torch.is_tensor(mine) and mine.dtype == shared.dtype and mine.shape == shared.shape:
                state[key] = shared
        return opt


class _StreamCeiling:
    """The bandwidth probe as a contender: ``step()`` is one 4-read/3-write pass over
    the shared buffers (param, grad, exp_avg, exp_avg_sq; grad is only read), or over
    `states` in their place (bf16 states: the 20-byte layout)."""

    def __init__(
        self, shared: _Shared, states: list[torch.Tensor] | None = None, pace: int = 0
    ) -> None:
        self.pace = pace
        states = list(shared.state.values()) if states is None else states
        # float32 as is, bfloat16 as its int16 bits: what the native kernels take
        self._views = [view(t) for t in (shared.param, shared.param.grad, *states)]

    def step(self) -> None:
        znative.stream_4r3w(*self._views, pace=self.pace)


def _quantile(xs: list[float], q: float) -> float:
    """The q-quantile of `xs`, interpolated (numpy's default method)."""
    ys = sorted(xs)
    pos = q * (len(ys) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def run(
    numel: int = 100_000_000,
    dtype: str = "fp32",
    steps: int = 10,
    warmup: int = 2,
) -> dict[str, Any]:
    """Time every contender; returns the JSON-able result."""
    if dtype not in BYTES_PER_PARAM:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if numel < 1 or steps < 1 or warmup < 0:
        raise ValueError(
            f"need numel >= 1, steps >= 1, warmup >= 0 (got {numel}, {steps}, {warmup})"
        )
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    # The same buffers for every contender (see the module docstring).
    shared = _Shared(numel)
    p = shared.param
    contenders: dict[str, tuple[torch.optim.Optimizer, int]] = {}
    state_dtype = torch.bfloat16 if dtype == "bf16-states" else torch.float32
    contenders["zstack_cpu_adam"] = (
        shared.adopt(CPUAdam([p], state_dtype=state_dtype, **hp)),
        BYTES_PER_PARAM[dtype],
    )
    if dtype == "bf16-states":
        contenders["zstack_cpu_adam_fp32"] = (
            shared.adopt(CPUAdam([p], **hp)),
            BYTES_PER_PARAM["fp32"],
        )
    contenders["torch_adam_fused"] = (
        shared.adopt(torch.optim.Adam([p], fused=True, **hp)),
        28,
    )
    contenders["torch_adam_foreach"] = (
        shared.adopt(torch.optim.Adam([p], foreach=True, **hp)),
        28,
    )
    ds_cls, ds_status = _deepspeed_adam()
    if ds_cls is not None:
        try:
            contenders["deepspeed_cpu_adam"] = (
                shared.adopt(ds_cls([p], adamw_mode=False, **hp)),
                28,
            )
        except Exception as e:  # its JIT build can fail on a machine without a compiler
            ds_status = f"failed to build: {type(e).__name__}: {e}".splitlines()[0][:200]

    # The ceiling runs in the same rounds as the optimizers, so it sees the same machine.
    timed: dict[str, Any] = {name: opt for name, (opt, _) in contenders.items()}
    for pace in PACES:
        timed[f"ceiling@{pace}"] = _StreamCeiling(shared, pace=pace)
    if dtype == "bf16-states":
        ours_state = contenders["zstack_cpu_adam"][0].state[p]
        for pace in PACES:
            timed[f"ceiling_bf16_states@{pace}"] = _StreamCeiling(
                shared, [ours_state["exp_avg"], ours_state["exp_avg_sq"]], pace
            )
    names = list(timed)
    times: dict[str, list[float]] = {name: [] for name in timed}
    for i in range(warmup + steps):
        # Rotate the order so no contender always follows the same neighbour.
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            timed[name].step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)

    ceiling = _ceiling(times, "ceiling", 28 * numel)
    ceiling_s, ceiling_gbps = ceiling["median_s"], ceiling["gb_per_s"]

    results: dict[str, dict[str, Any]] = {}
    for name, (_, bpp) in contenders.items():
        med = statistics.median(times[name])
        gbps = bpp * numel / med / 1e9
        results[name] = {
            "median_step_s": med,
            "min_step_s": min(times[name]),
            # spread: the quartiles of the timed steps
            "p25_step_s": _quantile(times[name], 0.25),
            "p75_step_s": _quantile(times[name], 0.75),
            "params_per_s": numel / med,
            "bytes_per_param": bpp,
            "gb_per_s": gbps,
            "fraction_of_ceiling": gbps / ceiling_gbps,
        }
    ours = results["zstack_cpu_adam"]["median_step_s"]
    speedup = {
        f"vs_{name}": results[name]["median_step_s"] / ours
        for name in results
        if name != "zstack_cpu_adam"
    }
    # Each round times every contender within a fraction of a second, so the ratio inside
    # one round cancels slow drifts in the machine's bandwidth that medians of each do not.
    ours_t = times["zstack_cpu_adam"]
    speedup_per_round = {
        f"vs_{name}": statistics.median(t / o for t, o in zip(times[name], ours_t, strict=True))
        for name in results
        if name != "zstack_cpu_adam"
    }
    out: dict[str, Any] = {
        "benchmark": "adam",
        "numel": numel,
        "dtype": dtype,
        "steps": steps,
        "warmup": warmup,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores_usable": len(os.sched_getaffinity(0)),
            "znative_threads": znative.num_threads(),
            "torch_threads": torch.get_num_threads(),
            "simd": znative.simd_level(),
            "torch": torch.__version__,
        },
        "ceiling": {
            "kernel": "stream 4 reads + 3 writes (znative.stream_4r3w), fastest pace",
            **ceiling,
            "params_per_s_at_28_bytes": numel / ceiling_s,
        },
        "results": results,
        "speedup_of_ours": speedup,
        "speedup_of_ours_per_round_median": speedup_per_round,
        "deepspeed_cpu_adam": ds_status,
    }
    if dtype == "bf16-states":
        c16 = _ceiling(times, "ceiling_bf16_states", BYTES_PER_PARAM[dtype] * numel)
        ours_r = results["zstack_cpu_adam"]
        ours_r["fraction_of_bf16_states_ceiling"] = c16["median_s"] / ours_r["median_step_s"]
        out["bf16_states_ceiling"] = {
            "kernel": "stream 4 reads + 3 writes, fp32 param/grad + 16-bit states, fastest pace",
            **c16,
            # the most a bf16-state step can gain over an fp32-state step here
            "speedup_bound": ceiling_s / c16["median_s"],
        }
    return out


def _ceiling(times: dict[str, list[float]], probe: str, nbytes: int) -> dict[str, Any]:
    """The fastest pace of `probe` (by median) and every pace's median."""
    medians = {pace: statistics.median(times[f"{probe}@{pace}"]) for pace in PACES}
    best = min(medians, key=lambda pace: medians[pace])
    return {
        "median_s": medians[best],
        "p25_s": _quantile(times[f"{probe}@{best}"], 0.25),
        "p75_s": _quantile(times[f"{probe}@{best}"], 0.75),
        "gb_per_s": nbytes / medians[best] / 1e9,
        "pace": best,
        "gb_per_s_by_pace": {str(pace): nbytes / m / 1e9 for pace, m in medians.items()},
    }


def report(result: dict[str, Any]) -> str:
    """A table a person can read; the JSON follows it."""
    c = result["ceiling"]
    lines = [
        f"adam step, numel {result['numel']:,}, {result['dtype']}, median of {result['steps']} steps, "
        f"{result['machine']['znative_threads']} threads, simd {result['machine']['simd']}",
        f"{'ceiling (stream 4r/3w)':<24} {c['median_s'] * 1e3:9.2f} ms  {c['gb_per_s']:7.2f} GB/s  "
        f"{c['params_per_s_at_28_bytes'] / 1e9:6.3f} Gparam/s  (pace {c['pace']})",
    ]
    c16 = result.get("bf16_states_ceiling")
    if c16 is not None:
        lines.append(
            f"{'ceiling (bf16 states)':<24} {c16['median_s'] * 1e3:9.2f} ms  {c16['gb_per_s']:7.2f} GB/s  "
            f"(pace {c16['pace']})  bound on bf16/fp32 speedup {c16['speedup_bound']:.3f}x"
        )
    for name, r in result["results"].items():
        lines.append(
            f"{name:<24} {r['median_step_s'] * 1e3:9.2f} ms  {r['gb_per_s']:7.2f} GB/s  "
            f"{r['params_per_s'] / 1e9:6.3f} Gparam/s  {r['fraction_of_ceiling'] * 100:5.1f}% of ceiling"
            + (
                f" ({r['fraction_of_bf16_states_ceiling'] * 100:.1f}% of the bf16-state one)"
                if "fraction_of_bf16_states_ceiling" in r
                else ""
            )
        )
    per_round = result["speedup_of_ours_per_round_median"]
    for name, s in result["speedup_of_ours"].items():
        lines.append(
            f"zstack_cpu_adam speedup {name}: {s:.3f}x (median of per-round ratios {per_round[name]:.3f}x)"
        )
    lines.append(f"deepspeed_cpu_adam: {result['deepspeed_cpu_adam']}")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--dtype", choices=DTYPES, default="fp32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ns = ap.parse_args()
    out = run(ns.numel, ns.dtype, ns.steps, ns.warmup)
    print(report(out))
    print(json.dumps(out))
