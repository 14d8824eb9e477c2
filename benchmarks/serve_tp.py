"""Tensor-parallel zserve against the single-process server on the same cores, same run.

tp=N with one thread per rank (torch and znative) against tp=1 with N threads (and, for
reference, tp=1 with one thread), on
SmolLM2-135M by default (9 query / 3 KV heads: tp=2 cuts them unevenly, KV 2/1). Each
contender runs in a process of its own (`_serve_tp_child.py`), the contenders alternating
``repeats`` times so a shared machine's load falls on both alike; each serves greedy
requests of ``prompt_tokens`` Shakespeare tokens and ``decode_tokens`` outputs:

* batch-1 decode: tokens/s of the decode steps after the first token (median of rounds);
* ``concurrent`` requests added at once: output tokens / wall time, prefill included.

Targets (issue 46): tp=N batch-1 decode >= 0.8x tp=1's, concurrent throughput >= 1.0x.
The batch-1 greedy tokens of both contenders must be equal (printed as ``same_tokens``).

Run: ``z bench serve --tp 2 [--decode-tokens 32] [--concurrent 16] [--repeats 2]``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CHILD = Path(__file__).resolve().parent / "_serve_tp_child.py"
DS_CHILD = Path(__file__).resolve().parent / "_serve_tp_deepspeed.py"
DS_DIR = Path.home() / ".cache/zstack/deepspeed"
"""Where `make bench-deepspeed` installs DeepSpeed beside the environment."""


def _default_model() -> Path:
    return Path.home() / ".cache/zstack/models/SmolLM2-135M-Instruct"


def _prompts(model_dir: Path, count: int, length: int) -> list[list[int]]:
    from zserve.tokenizer import Tokenizer
    from ztrain.data import load_plays

    ids = Tokenizer(model_dir).encode(
        dict(load_plays())["Hamlet"][:100_000], add_special_tokens=False
    )
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def _child(args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    env = {**os.environ, "ZNATIVE_NUM_THREADS": str(args["threads"])}
    env["OMP_NUM_THREADS"] = str(args["threads"])
    try:
        done = subprocess.run(
            [sys.executable, str(CHILD), json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-600:]}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _deepspeed(args: dict[str, Any], tp: int, timeout_s: float) -> dict[str, Any]:
    """DeepSpeed AutoTP on ``tp`` gloo ranks (one thread each), or why it did not run."""
    if not (DS_DIR / "deepspeed").is_dir():
        return {"error": f"DeepSpeed is not installed beside at {DS_DIR}: `make bench-deepspeed`"}
    from zcore.process import free_port

    port = free_port()
    env = {**os.environ, "ZNATIVE_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env |= {"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DS_DIR), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(DS_DIR / "bin"), env.get("PATH", "")])  # its ninja
    ranks = [
        subprocess.Popen(
            [sys.executable, str(DS_CHILD), json.dumps({**args, "threads": 1})],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(tp)},
        )
        for r in range(tp)
    ]
    try:
        outs = [p.communicate(timeout=timeout_s) for p in ranks]
    except subprocess.TimeoutExpired:
        for p in ranks:
            p.kill()
        return {"error": f"timed out after {timeout_s:.0f} s"}
    bad = [
        (r, p.returncode, e)
        for r, (p, (_, e)) in enumerate(zip(ranks, outs, strict=True))
        if p.returncode
    ]
    if bad:
        r, code, err = bad[0]
        return {"error": f"rank {r} exit {code}: {err.strip()[-600:]}"}
    return dict(json.loads(outs[0][0].strip().splitlines()[-1]))


def _cpu() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import znative

    return {
        "cpu": model,
        "simd": znative.simd_level(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "load_avg": os.getloadavg(),
    }


def run(
    model_dir: str | None = None,
    tp: int = 2,
    prompt_tokens: int = 64,
    decode_tokens: int = 32,
    concurrent: int = 16,
    rounds: int = 2,
    repeats: int = 2,
    dtype: str = "float32",
    timeout_s: float = 600.0,
    peers: str = "deepspeed",
) -> dict[str, Any]:
    """tp=``tp`` (1 thread a rank) vs tp=1 (``tp`` threads), and DeepSpeed AutoTP at tp=``tp``
    when ``peers`` names it, alternating ``repeats`` times."""
    mdir = Path(model_dir) if model_dir else _default_model()
    base = {
        "model_dir": str(mdir),
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "concurrent": concurrent,
        "rounds": rounds,
        "dtype": dtype,
        "prompts": _prompts(mdir, concurrent + 1, prompt_tokens),
    }
    contenders = {
        "tp1": {"tp": 1, "threads": tp},
        "tp1_1thread": {"tp": 1, "threads": 1},  # a reference: one process on one core
        f"tp{tp}": {"tp": tp, "threads": 1},
    }
    machine = _cpu()
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in contenders}
    t0 = time.perf_counter()
    use_ds = "deepspeed" in peers.split(",") and dtype == "float32"
    if use_ds:
        runs["deepspeed"] = []
    for _ in range(repeats):
        for name, who in contenders.items():
            runs[name].append(_child({**base, **who}, timeout_s))
        if use_ds and "error" not in (runs["deepspeed"] or [{}])[-1]:
            runs["deepspeed"].append(_deepspeed(base, tp, timeout_s))
    result: dict[str, Any] = {
        "benchmark": "serve_tp",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": mdir.name,
        "tp": tp,
        "dtype": dtype,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "concurrent": concurrent,
        "machine": {**machine, "load_avg_after": os.getloadavg()},
        "wall_s": time.perf_counter() - t0,
        "runs": runs,
    }
    ds = runs.pop("deepspeed", [])
    if ds and "error" in ds[-1]:
        result["deepspeed_error"] = ds[-1]["error"]
        ds = []
    errors = {k: r["error"] for k, rs in runs.items() for r in rs if "error" in r}
    if errors:
        result["errors"] = errors
        return result
    if ds:
        runs["deepspeed"] = ds

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    one, many = "tp1", f"tp{tp}"
    result["batch1_tokens_per_s"] = {k: med(k, "batch1_tokens_per_s") for k in runs}
    result["concurrent_tokens_per_s"] = {k: med(k, "concurrent_tokens_per_s") for k in runs}
    if ds:
        result["vs_deepspeed"] = {
            key: med(many, key) / med("deepspeed", key)
            for key in ("batch1_tokens_per_s", "concurrent_tokens_per_s")
        }
        result["deepspeed_same_tokens"] = all(
            r["batch1_tokens"] == runs[one][0]["batch1_tokens"] for r in ds
        )
    result["batch1_ratio"] = med(many, "batch1_tokens_per_s") / med(one, "batch1_tokens_per_s")
    result["concurrent_ratio"] = med(many, "concurrent_tokens_per_s") / med(
        one, "concurrent_tokens_per_s"
    )
    result["vs_tp1_1thread"] = {
        key: med(many, key) / med("tp1_1thread", key)
        for key in ("batch1_tokens_per_s", "concurrent_tokens_per_s")
    }
    result["targets"] = {
        "batch1_ratio >= 0.8": result["batch1_ratio"] >= 0.8,
        "concurrent_ratio >= 1.0": result["concurrent_ratio"] >= 1.0,
    }
    result["same_tokens"] = all(
        r["batch1_tokens"] == runs[one][0]["batch1_tokens"] for k in contenders for r in runs[k]
    )
    if ds:
        result["targets"]["vs DeepSpeed AutoTP >= 1.0"] = min(result["vs_deepspeed"].values()) >= 1
    return result


def report(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"serve tp={r['tp']} (1 thread a rank) vs tp=1 ({r['tp']} threads): {r['model']} "
        f"{r['dtype']}, {r['prompt_tokens']}-token prompts, {r['decode_tokens']} outputs",
        f"machine: {m['cpu']} ({m['simd']}), {m['cores_usable']} cores, load "
        f"{m['load_avg'][0]:.1f} -> {m['load_avg_after'][0]:.1f}",
    ]
    if "errors" in r:
        return "\n".join([*lines, *(f"error {k}: {v}" for k, v in r["errors"].items())])
    for key, label in (
        ("batch1_tokens_per_s", "batch-1 decode"),
        ("concurrent_tokens_per_s", f"{r['concurrent']} concurrent"),
    ):
        vals = ", ".join(f"{k} {v:.1f} tok/s" for k, v in r[key].items())
        lines.append(f"{label}: {vals}")
    if "vs_deepspeed" in r:
        v = r["vs_deepspeed"]
        lines.append(
            f"vs DeepSpeed AutoTP tp={r['tp']}: batch-1 {v['batch1_tokens_per_s']:.2f}x, "
            f"concurrent {v['concurrent_tokens_per_s']:.2f}x (target >= 1.0)"
        )
    if "deepspeed_error" in r:
        lines.append(f"DeepSpeed AutoTP did not run: {r['deepspeed_error']}")
    lines.append(
        f"ratios: batch-1 {r['batch1_ratio']:.2f} (target >= 0.8), concurrent "
        f"{r['concurrent_ratio']:.2f} (target >= 1.0); same greedy tokens: {r['same_tokens']}"
    )
    return "\n".join(lines)
