"""ZeRO training-step time and peak memory: zcore's engine against DeepSpeed's, side by side.

The same GPT (``z train``'s, default preset "medium", ~26.8M parameters), the same
seeded init, the same random token batches, the same DeepSpeed-style config (fp32,
AdamW, ``gradient_clipping``, bucket sizes at their defaults) on N gloo ranks, through
``zcore.initialize`` and through ``deepspeed.initialize`` when DeepSpeed imports in this
interpreter (it is never a dependency).

Per stage and round there are three runs, each in fresh rank processes:

- both engines built in the same ranks, stepping in turn on the same batch (who goes
  first alternates), so machine noise hits both alike: the step times, the per-step
  ratio, CPU seconds per step and the losses (same math, so they should agree) come
  from here;
- each engine alone (the order alternates per stage and round): its peak RSS
  (``VmHWM``) and a second timing, more exposed to noise.

A step is forward + backward + ``step()``; its time is the slowest rank's. Without
DeepSpeed only zcore's run alone is done.

Run (in an environment with DeepSpeed): ``z bench zero-step --stages 1,2,3 --json``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from zcore.bench import load

_ranks = load("_ranks", Path(__file__).parent)

SIDES = ("ours", "deepspeed")
PHASES = ("forward", "backward", "step")


def ds_config(opt: dict[str, Any], stage: int) -> dict[str, Any]:
    """The one config both engines get (zcore reads DeepSpeed's JSON)."""
    return {
        "train_micro_batch_size_per_gpu": opt["micro_batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": opt["lr"], "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "gradient_clipping": opt["gradient_clipping"],
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _engine(side: str, model: Any, config: dict[str, Any]) -> tuple[Any, str, str]:
    """``(engine, inner optimizer class, ZeRO optimizer class)`` from either library."""
    if side == "deepspeed":
        import deepspeed  # type: ignore[import-not-found]

        engine, zopt, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        return engine, _qualname(getattr(zopt, "optimizer", zopt)), _qualname(zopt)
    import zcore

    engine, inner, _, _ = zcore.initialize(model, config=config)
    return engine, _qualname(inner), _qualname(engine.zopt)


def _rank_main(spec: dict[str, Any]) -> None:
    """One rank of one run: build one engine per side, time alternating steps, write JSON."""
    rank, world, sides, opt = spec["rank"], spec["world"], spec["sides"], spec["options"]
    # the rendezvous variables come from _ranks.launch; these must be set before torch loads
    os.environ.update(LOCAL_SIZE=str(world), ZNATIVE_NUM_THREADS=str(opt["threads"]))
    import torch
    import torch._dynamo  # torch.optim loads it on first use (~170 MB): keep it out of the deltas
    import torch.distributed as dist

    torch.set_num_threads(opt["threads"])
    from ztrain.gpt import GPT, GPTConfig

    if "deepspeed" in sides:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = GPTConfig.preset(opt["preset"], vocab_size=opt["vocab_size"])
    total = opt["warmup"] + opt["steps"]
    g = torch.Generator().manual_seed(opt["seed"])
    tokens = torch.randint(
        0, cfg.vocab_size, (total, world, opt["micro_batch"], opt["seq"] + 1), generator=g
    )  # (step, rank, B, T + 1): every rank draws all batches, keeps its own
    models = {side: GPT(cfg, seed=opt["seed"]) for side in sides}  # identical weights
    n_params = next(iter(models.values())).num_params()  # before stage 3 empties them
    mem_before = _ranks.memory_mb()
    config = ds_config(opt, spec["stage"])
    engines, result = {}, {}
    for side in sides:
        engines[side], inner, zopt = _engine(side, models[side], config)
        times: dict[str, list[float]] = {k: [] for k in (*PHASES, "total", "cpu")}
        result[side] = {"optimizer": inner, "zero_optimizer": zopt, "times": times, "losses": []}
    mem_init = _ranks.memory_mb()

    profilers: dict[str, Any] = {}
    if opt["profile"] and rank == 0:
        import cProfile

        profilers = {side: cProfile.Profile() for side in sides}
    for i in range(total):
        x, y = tokens[i, rank, :, :-1], tokens[i, rank, :, 1:]  # (B, T) each
        for side in sides if i % 2 == 0 else sides[::-1]:  # who goes first alternates
            engine, prof = engines[side], profilers.get(side) if i >= opt["warmup"] else None
            dist.barrier()  # every rank starts the step together; not timed
            if prof is not None:
                prof.enable()
            c0, t0 = time.process_time(), time.perf_counter()
            loss = engine(x, y)[1]
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3, c3 = time.perf_counter(), time.process_time()
            if prof is not None:
                prof.disable()
            result[side]["losses"].append(float(loss.detach()))
            if i >= opt["warmup"]:
                laps = (t1 - t0, t2 - t1, t3 - t2, t3 - t0, c3 - c0)
                for k, v in zip((*PHASES, "total", "cpu"), laps, strict=True):
                    result[side]["times"][k].append(v)
    for side in sides:
        prof = profilers.get(side)
        result[side]["profile"] = _top_functions(prof, opt["steps"]) if prof else None
    process = {
        "rank": rank,
        "params": n_params,
        "rss_before_init_mb": mem_before.get("VmRSS"),
        "rss_after_init_mb": mem_init.get("VmRSS"),
        "peak_rss_mb": _ranks.memory_mb()["VmHWM"],
        "torch_threads": torch.get_num_threads(),
    }
    _ranks.write_result(spec, {"process": process, "sides": result})
    dist.barrier()
    dist.destroy_process_group()


def _top_functions(profiler: Any, steps: int, n: int = 30) -> list[dict[str, Any]]:
    """The ``n`` functions with the most own time, per timed step."""
    import pstats

    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [
        {
            "function": f"{os.path.basename(fn)}:{line}({name})",
            "calls_per_step": nc / steps,
            "own_ms_per_step": 1e3 * tt / steps,
            "cumulative_ms_per_step": 1e3 * ct / steps,
        }
        for (fn, line, name), (_, nc, tt, ct, _) in rows
    ]


def _deepspeed_status(env: dict[str, str]) -> tuple[str | None, str]:
    """DeepSpeed's version if ``import deepspeed`` works in this interpreter, and why not."""
    code = "import deepspeed, sys; sys.stdout.write('\\nVERSION ' + deepspeed.__version__)"
    try:
        p = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return None, "`import deepspeed` took over 300 s"
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if p.returncode == 0 and last.startswith("VERSION "):
        return last.split(" ", 1)[1], "ok"
    err = p.stderr.strip().splitlines()
    return (
        None,
        f"`import deepspeed` failed in {sys.executable}: {err[-1] if err else p.returncode}",
    )


def _launch(sides: tuple[str, ...], stage: int, opt: dict, env: dict, tmp: str) -> list[dict]:
    """Start ``world_size`` fresh ranks for one run; return their results (rank order)."""
    spec = {"sides": sides, "stage": stage, "options": opt}
    what = f"{'+'.join(sides)} stage {stage}"
    return _ranks.launch(
        __file__, opt["world_size"], spec, tmp, timeout_s=opt["timeout_s"], what=what, env=env
    )


def _slowest(runs: list[list[dict]], side: str, key: str = "total") -> list[float]:
    """Per timed step, the slowest rank's time (a step ends when every rank is done)."""
    out: list[float] = []
    for ranks in runs:
        out += [max(t) for t in zip(*(r["sides"][side]["times"][key] for r in ranks), strict=True)]
    return out


def _summary(timing: list[list[dict]], memory: list[list[dict]], side: str) -> dict[str, Any]:
    """One engine at one stage: step times from ``timing`` runs, peak RSS from ``memory`` runs."""
    steps = _slowest(timing, side)
    isolated = _slowest(memory, side)
    first = timing[0]
    losses = [
        statistics.fmean(s) for s in zip(*(r["sides"][side]["losses"] for r in first), strict=True)
    ]
    out = {
        "median_step_s": statistics.median(steps),
        "min_step_s": min(steps),
        "step_s": steps,
        "phases_median_s": {k: statistics.median(_slowest(timing, side, k)) for k in PHASES},
        "median_cpu_s": statistics.median(_slowest(timing, side, "cpu")),
        "isolated_median_step_s": statistics.median(isolated),
        "isolated_step_s": isolated,
        "peak_rss_mb": [
            max(run[i]["process"]["peak_rss_mb"] for run in memory) for i in range(len(memory[0]))
        ],
        "rss_before_init_mb": [r["process"]["rss_before_init_mb"] for r in memory[0]],
        "rss_after_init_mb": [r["process"]["rss_after_init_mb"] for r in memory[0]],
        "losses": losses,
        "final_loss": losses[-1],
        "optimizer": first[0]["sides"][side]["optimizer"],
        "zero_optimizer": first[0]["sides"][side]["zero_optimizer"],
        "torch_threads": memory[0][0]["process"]["torch_threads"],
    }
    profile = first[0]["sides"][side]["profile"]
    if profile:
        out["profile_rank0"] = profile
    return out


def _compare(ours: dict[str, Any], ds: dict[str, Any], paired: list[list[dict]]) -> dict:
    per_step = [
        o / d for o, d in zip(_slowest(paired, "ours"), _slowest(paired, "deepspeed"), strict=True)
    ]
    return {
        "step_time_ratio_ours_over_ds": ours["median_step_s"] / ds["median_step_s"],
        "step_time_ratio_per_step_median": statistics.median(per_step),
        "cpu_time_ratio_ours_over_ds": ours["median_cpu_s"] / ds["median_cpu_s"],
        "isolated_step_time_ratio_ours_over_ds": (
            ours["isolated_median_step_s"] / ds["isolated_median_step_s"]
        ),
        "peak_rss_ratio_ours_over_ds": max(ours["peak_rss_mb"]) / max(ds["peak_rss_mb"]),
        "max_abs_loss_diff": max(
            abs(a - b) for a, b in zip(ours["losses"], ds["losses"], strict=True)
        ),
    }


def run(
    preset: str = "medium",
    stages: str = "1,2,3",
    steps: int = 5,
    warmup: int = 2,
    rounds: int = 1,
    micro_batch: int = 4,
    seq: int | None = None,
    world_size: int = 2,
    threads: int = 1,
    gradient_clipping: float = 1.0,
    lr: float = 1e-4,
    seed: int = 0,
    deepspeed: bool = True,
    profile: bool = False,
    timeout_s: float = 1800,
) -> dict[str, Any]:
    """Time both engines per stage; returns the JSON-able result.

    Per stage and round: one run with both engines in the same ranks, stepping in turn
    (the step times and losses compared), then one run per engine alone (its peak RSS,
    and a second, less noise-proof timing). Without DeepSpeed only the last is done.
    """
    from zcore.bench import numbers
    from ztrain.gpt import PRESETS, default_seq_len

    if preset not in PRESETS:
        raise ValueError(f"--preset {preset!r}: choose one of {sorted(PRESETS)}")
    block = PRESETS[preset]["block_size"]
    seq = default_seq_len(preset) if seq is None else seq
    if seq > block:
        raise ValueError(
            f"--seq {seq} exceeds preset {preset}'s block_size {block}; pass --seq {block} "
            "or less (or leave it out)"
        )
    stage_list = numbers("--stages", stages)
    if any(s not in (0, 1, 2, 3) for s in stage_list):
        raise ValueError(f"--stages {stages!r}: need comma-separated ZeRO stages from 0-3")
    if steps < 1 or warmup < 0 or rounds < 1 or world_size < 1 or threads < 1:
        raise ValueError(
            f"need steps >= 1, warmup >= 0, rounds >= 1, world_size >= 1, threads >= 1 "
            f"(got {steps}, {warmup}, {rounds}, {world_size}, {threads})"
        )
    opt = dict(
        preset=preset,
        vocab_size=2048,
        steps=steps,
        warmup=warmup,
        micro_batch=micro_batch,
        seq=seq,
        world_size=world_size,
        threads=threads,
        gradient_clipping=gradient_clipping,
        lr=lr,
        seed=seed,
        profile=profile,
        timeout_s=timeout_s,
    )
    env = dict(os.environ)
    # DeepSpeed JIT-builds its CPU ops with the interpreter's venv tools (ninja).
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("DS_ACCELERATOR", "cpu")
    ds_version, ds_status = _deepspeed_status(env) if deepspeed else (None, "disabled (--no-ds)")
    sides = SIDES if ds_version else SIDES[:1]

    paired: dict[int, list[list[dict]]] = {s: [] for s in stage_list}
    alone: dict[tuple[str, int], list[list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="zero_step_") as tmp:
        for r in range(rounds):
            for stage in stage_list:
                if len(sides) > 1:
                    paired[stage].append(_launch(sides, stage, opt, env, tmp))
                # Alternate which engine goes first so neither always gets the quieter machine.
                for side in sides if (r + stage) % 2 == 0 else sides[::-1]:
                    runs = alone.setdefault((side, stage), [])
                    runs.append(_launch((side,), stage, opt, env, tmp))

    rows = []
    for stage in stage_list:
        timing = paired[stage] or alone[("ours", stage)]
        ours = _summary(timing, alone[("ours", stage)], "ours")
        row: dict[str, Any] = {"stage": stage, "ours": ours, "deepspeed": None}
        if len(sides) > 1:
            row["deepspeed"] = ds = _summary(timing, alone[("deepspeed", stage)], "deepspeed")
            row.update(_compare(ours, ds, timing))
        rows.append(row)
    return {
        "benchmark": "zero_step",
        "model": f"GPT preset {preset!r}, vocab 2048",
        "params": alone[("ours", stage_list[0])][0][0]["process"]["params"],
        "world_size": world_size,
        "micro_batch": micro_batch,
        "seq": seq,
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "precision": "fp32",
        "timing": "both engines in the same ranks, alternating steps"
        if len(sides) > 1
        else "zcore alone",
        "config": ds_config(opt, stage_list[0]) | {"zero_optimization": {"stage": "per row"}},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores_usable": len(os.sched_getaffinity(0)),
            "threads_per_rank": threads,
            "python": sys.executable,
        },
        "deepspeed_version": ds_version,
        "deepspeed_status": ds_status,
        "stages": rows,
    }


def report(result: dict[str, Any]) -> str:
    """A table a person can read; the JSON follows it."""
    lines = [
        f"ZeRO step, {result['model']} ({result['params']:,} params), {result['world_size']} "
        f"gloo ranks, micro batch {result['micro_batch']} x seq {result['seq']}, fp32, median of "
        f"{result['steps']} steps x {result['rounds']} round(s), timing: {result['timing']}",
        f"deepspeed: {result['deepspeed_version'] or result['deepspeed_status']}",
        "stage  engine      step s   fwd s   bwd s  step() s   CPU s  alone s  peak RSS MB/rank"
        "  final loss",
    ]
    for row in result["stages"]:
        for name in SIDES:
            s = row[name]
            if s is None:
                continue
            ph = s["phases_median_s"]
            rss = "/".join(f"{m:.0f}" for m in s["peak_rss_mb"])
            lines.append(
                f"{row['stage']:>5}  {name:<10} {s['median_step_s']:7.3f} {ph['forward']:7.3f} "
                f"{ph['backward']:7.3f} {ph['step']:9.3f} {s['median_cpu_s']:7.3f} "
                f"{s['isolated_median_step_s']:8.3f} "
                f"{rss:>17}  {s['final_loss']:.5f}"
            )
        if row["deepspeed"] is not None:
            lines.append(
                f"{'':>5}  ours/ds step time {row['step_time_ratio_ours_over_ds']:.3f}x "
                f"(per-step {row['step_time_ratio_per_step_median']:.3f}x, alone "
                f"{row['isolated_step_time_ratio_ours_over_ds']:.3f}x), CPU s/step "
                f"{row['cpu_time_ratio_ours_over_ds']:.3f}x, peak RSS "
                f"{row['peak_rss_ratio_ours_over_ds']:.3f}x, max |loss diff| "
                f"{row['max_abs_loss_diff']:.2e}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    rank_spec = _ranks.rank_spec(sys.argv)
    if rank_spec is not None:  # one rank, started by run() through _ranks.launch
        _rank_main(rank_spec)
        sys.exit(0)
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="default: the preset's, at most 256")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--no-ds", action="store_true", help="Time zcore only.")
    ap.add_argument("--profile", action="store_true", help="cProfile rank 0's timed steps.")
    ns = ap.parse_args()
    out = run(
        ns.preset,
        ns.stages,
        ns.steps,
        ns.warmup,
        ns.rounds,
        ns.micro_batch,
        ns.seq,
        ns.world_size,
        deepspeed=not ns.no_ds,
        profile=ns.profile,
    )
    print(report(out))
    print(json.dumps(out))
