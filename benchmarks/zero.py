"""ZeRO model-state memory per rank, measured against the paper's formula.

Builds the `z train` GPT (default preset "small") on N real gloo ranks for stages
0-3 in mixed precision (bf16 parameters and gradients, fp32 master weights and Adam
state) and counts, on every rank, the bytes of the tensors the engine actually holds
(`engine.model_state_bytes()`): parameters, gradients, optimizer state. Stage 3 builds
the model under `zcore.zero.Init`, so the whole model never exists on one rank.

Measured mid-accumulation (after the first micro-batch's backward of a 2-micro-batch
step): the state that persists across micro-steps. That is what the formula counts:
Ψ parameters, N ranks, stage 0: 16Ψ; 1: 4Ψ + 12Ψ/N; 2: 2Ψ + 14Ψ/N; 3: 16Ψ/N.

Run: ``z bench zero --world-size 4 --json``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zcore.bench import load

_ranks = load("_ranks", Path(__file__).parent)


def _rank(spec: dict[str, Any]) -> None:
    """One rank (started by :func:`run` through ``_ranks.launch``): every stage's bytes."""
    rank, world, preset = spec["rank"], spec["world"], spec["preset"]
    stages = [int(s) for s in spec["stages"].split(",")]
    torch.set_num_threads(1)
    import zcore
    from zcore.zero import Init
    from ztrain.gpt import GPT, GPTConfig

    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg_model = GPTConfig.preset(preset, vocab_size=2048)
    seq, mb = 64, 2
    rows = []
    for stage in stages:
        config = {
            "train_micro_batch_size_per_gpu": mb,
            "gradient_accumulation_steps": 2,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": stage},
        }
        with Init(enabled=stage == 3):
            model = GPT(cfg_model)
        engine, *_ = zcore.initialize(model, config=config)
        psi = sum(p.z_numel if hasattr(p, "z_numel") else p.numel() for _, p in _unique(model))
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, 2048, (mb, seq), generator=g)
        for _ in range(2):  # one full step so optimizer state exists
            engine.backward(engine(x, x)[1])
            engine.step()
        engine.backward(engine(x, x)[1])  # first micro-batch of the next step
        measured = engine.model_state_bytes()
        engine.step()
        engine.destroy()
        rows.append(
            {
                "stage": stage,
                "params": psi,
                "param_bytes": measured["params"],
                "grads": measured["grads"],
                "optimizer": measured["optimizer"],
            }
        )
        del engine, model
    _ranks.write_result(spec, rows)
    dist.destroy_process_group()


def _unique(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for n, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


def run(world_size: int = 4, preset: str = "small", stages: str = "0,1,2,3") -> dict[str, Any]:
    from zcore.bench import numbers
    from zcore.memory import formula_bytes

    bad = [s for s in numbers("--stages", stages) if s not in (0, 1, 2, 3)]  # validate early
    if bad:
        raise ValueError(f"--stages {stages!r}: {bad} not ZeRO stages; give stages from 0-3")
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"preset": preset, "stages": stages}
        ranks = _ranks.launch(__file__, world_size, spec, tmp, timeout_s=1800, what="z bench zero")
    rows = ranks[0]
    report_rows = []
    for row in rows:
        psi = row["params"]
        formula = formula_bytes(psi, world_size, row["stage"])
        measured_total = row["param_bytes"] + row["grads"] + row["optimizer"]
        report_rows.append(
            {
                "stage": row["stage"],
                "measured": {
                    "params": row["param_bytes"],
                    "grads": row["grads"],
                    "optimizer": row["optimizer"],
                    "total": measured_total,
                },
                "formula_total": formula,
                "ratio": measured_total / formula,
                "within_10pct": abs(measured_total / formula - 1) <= 0.10,
            }
        )
    return {
        "benchmark": "zero",
        "world_size": world_size,
        "preset": preset,
        "params": rows[0]["params"],
        "precision": "bf16 params/grads, fp32 master + AdamW state",
        "stages": report_rows,
        "max_abs_deviation": max(abs(r["ratio"] - 1) for r in report_rows),
        "median_ratio": statistics.median(r["ratio"] for r in report_rows),
    }


def report(result: dict[str, Any]) -> str:
    mib = 2**20
    lines = [
        f"ZeRO model states per rank: {result['params']:,} params, {result['world_size']} ranks, "
        f"{result['precision']}",
        "stage   params MiB   grads MiB   optim MiB   total MiB   formula MiB   ratio",
    ]
    for r in result["stages"]:
        m = r["measured"]
        lines.append(
            f"{r['stage']:>5} {m['params'] / mib:12.1f} {m['grads'] / mib:11.1f} "
            f"{m['optimizer'] / mib:11.1f} {m['total'] / mib:11.1f} "
            f"{r['formula_total'] / mib:13.1f} {r['ratio']:7.3f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # one rank, started by run() through _ranks.launch
    spec = _ranks.rank_spec(sys.argv)
    if spec is None:
        sys.exit("this file runs as a rank of `z bench zero`; run that instead")
    _rank(spec)
