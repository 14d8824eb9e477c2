"""Tensor-parallel zserve against the single-process server on the same cores, same run.

tp=N with one thread per rank (torch and znative) against tp=1 with N threads (and, for
reference, tp=1 with one thread), on
SmolLM2-135M by default (9 query / 3 KV heads: tp=2 cuts them unevenly, KV 2/1). Each
contender runs in a process of its own (`_serve_tp_child.py`), the contenders alternating
``repeats`` times so a shared machine's load falls on both alike; each serves greedy
requests of ``prompt_tokens`` Shakespeare tokens and ``decode_tokens`` outputs:

* batch-1 decode: tokens/s of the decode steps after the first token (median of rounds);
* ``concurrent`` requests added at once: output tokens / wall time, prefill included.

tp=N carries its layers' all-reduces as torch.distributed point-to-point exchanges (zserve's
default, ``p2p``); with ``gloo`` (on by default) a ``tpN_gloo`` contender runs the same ranks
over gloo's collectives, for reference.

Idle cores (``EngineConfig.cpu_idle``, :mod:`zserve.cpu_idle`): by default tp=N holds Linux's
CPU latency QoS at 0 us while requests are in flight where the process may (root), tp=1 does
not. With ``idle`` (on by default, where the QoS device is writable) two more contenders run
the other way round, ``tp1_poll`` and ``tpN_halt``, and the ratios are taken against the
faster of ``tp1`` and ``tp1_poll``: the baseline gets whatever helps it.

Peers (``peers``, both by default), at tp=N on the same cores, one thread a rank: DeepSpeed
AutoTP (``deepspeed.init_inference``, installed beside) and transformers' own tensor
parallelism (``from_pretrained(tp_plan="auto")``, DTensor), each in ``_serve_tp_peer.py``. A
peer that fails (transformers' plan cannot cut SmolLM2's 9 query heads over 2 ranks) is
reported with its error.

``quantized`` (``--tp-recipes w8a8,w4,w6a16``) adds, per recipe, the `z quantize` directory of
the model (made in ``quant_dir`` unless already there) at tp=1 (N threads) and tp=N: rows
``tp1_<recipe>`` and ``tpN_<recipe>``, their ratios in ``quantized`` (no peers, no targets:
indicative).

Targets (issue 46): tp=N batch-1 decode >= 0.8x tp=1's, concurrent throughput >= 1.0x, and
>= 1.0x each peer that runs.
The batch-1 greedy tokens of both contenders must be equal (printed as ``same_tokens``).

Run: ``z bench serve --tp 2 [--decode-tokens 32] [--concurrent 16] [--repeats 2]``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from zcore.bench import load

_models = load("_models", Path(__file__).parent)
_ranks = load("_ranks", Path(__file__).parent)

CHILD = Path(__file__).resolve().parent / "_serve_tp_child.py"
PEER_CHILD = Path(__file__).resolve().parent / "_serve_tp_peer.py"
DS_DIR = Path.home() / ".cache/zstack/deepspeed"
"""Where `make bench-deepspeed` installs DeepSpeed beside the environment."""


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


PEERS = {"deepspeed": "DeepSpeed AutoTP", "transformers": "transformers tp_plan"}
"""The peers `--peers` may name, and how the report calls them."""


def _peer(peer: str, args: dict[str, Any], tp: int, timeout_s: float) -> dict[str, Any]:
    """A peer (see ``_serve_tp_peer.py``) on ``tp`` gloo ranks, one thread each, or why it
    did not run."""
    from zcore.process import free_port

    port = free_port()
    env = {**os.environ, "ZNATIVE_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if peer == "deepspeed":
        if not (DS_DIR / "deepspeed").is_dir():
            return {
                "error": f"DeepSpeed is not installed beside at {DS_DIR}: `make bench-deepspeed`"
            }
        env["DS_ACCELERATOR"] = "cpu"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DS_DIR), env.get("PYTHONPATH")]))
        env["PATH"] = os.pathsep.join([str(DS_DIR / "bin"), env.get("PATH", "")])  # its ninja
    ranks = [
        subprocess.Popen(
            [sys.executable, str(PEER_CHILD), json.dumps({**args, "threads": 1, "peer": peer})],
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


def _quantized(model_dir: Path, recipes: str, quant_dir: str | None) -> dict[str, Path]:
    """Each recipe of ``recipes`` -> its `z quantize` directory of ``model_dir``."""
    if not recipes:
        return {}
    import tempfile

    serve_quant = load("serve_quant", Path(__file__).parent)
    names = serve_quant.check_recipes(recipes)
    root = Path(quant_dir) if quant_dir else Path(tempfile.mkdtemp(prefix="zserve-tp-quant-"))
    return {q: serve_quant.quantized_dir(model_dir, q, root)[0] for q in names}


def _qos_writable() -> bool:
    """This process may hold the CPU latency QoS (the engine's ``cpu_idle="poll"``)."""
    from zserve.cpu_idle import unavailable

    return unavailable() is None


def _cpu() -> dict[str, Any]:
    import znative

    return {
        "cpu": _ranks.cpu_name(),
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
    peers: str = "deepspeed,transformers",
    quantized: str = "",
    quant_dir: str | None = None,
    gloo: bool = True,
    idle: bool = True,
) -> dict[str, Any]:
    """tp=``tp`` (1 thread a rank) vs tp=1 (``tp`` threads), and each peer of ``peers``
    (DeepSpeed AutoTP, transformers' ``tp_plan``) at tp=``tp``, alternating ``repeats``
    times. A peer that fails is reported with its error and not run again. ``quantized``:
    comma-separated zquant recipes whose directories also run at tp=1 and tp=``tp``."""
    wanted = [p for p in peers.split(",") if p]
    unknown = sorted(set(wanted) - set(PEERS))
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; --peers takes {', '.join(PEERS)}")
    if dtype != "float32":
        wanted = []  # the peers run float32 models
    mdir = Path(model_dir) if model_dir else _models.default_model_dir()
    base = {
        "model_dir": str(mdir),
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "concurrent": concurrent,
        "rounds": rounds,
        "dtype": dtype,
        "prompts": _models.shakespeare_prompts(mdir, concurrent + 1, prompt_tokens),
    }
    contenders = {
        "tp1": {"tp": 1, "threads": tp},
        "tp1_1thread": {"tp": 1, "threads": 1},  # a reference: one process on one core
        f"tp{tp}": {"tp": tp, "threads": 1},
    }
    if gloo:  # a reference: the same ranks, their collectives over gloo
        contenders[f"tp{tp}_gloo"] = {"tp": tp, "threads": 1, "collectives": "gloo"}
    idle = idle and _qos_writable()
    if idle:  # each the other way round: what polling idle cores gives either
        contenders["tp1_poll"] = {"tp": 1, "threads": tp, "cpu_idle": "poll"}
        contenders[f"tp{tp}_halt"] = {"tp": tp, "threads": 1, "cpu_idle": "halt"}
    recipes = _quantized(mdir, quantized, quant_dir)
    for recipe, qdir in recipes.items():
        contenders[f"tp1_{recipe}"] = {"tp": 1, "threads": tp, "model_dir": str(qdir)}
        contenders[f"tp{tp}_{recipe}"] = {"tp": tp, "threads": 1, "model_dir": str(qdir)}
    machine = _cpu()
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in contenders}
    t0 = time.perf_counter()
    for peer in wanted:
        runs[peer] = []
    for _ in range(repeats):
        for name, who in contenders.items():
            runs[name].append(_child({**base, **who}, timeout_s))
        for peer in wanted:
            if "error" not in (runs[peer] or [{}])[-1]:
                runs[peer].append(_peer(peer, base, tp, timeout_s))
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
    peer_runs = {peer: runs.pop(peer) for peer in wanted}
    for peer, got in peer_runs.items():
        if "error" in got[-1]:
            result[f"{peer}_error"] = got[-1]["error"]
    ran = [peer for peer in wanted if f"{peer}_error" not in result]
    errors = {k: r["error"] for k, rs in runs.items() for r in rs if "error" in r}
    if errors:
        result["errors"] = errors
        return result
    for peer in ran:
        runs[peer] = peer_runs[peer]

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    one, many = "tp1", f"tp{tp}"
    result["batch1_tokens_per_s"] = {k: med(k, "batch1_tokens_per_s") for k in runs}
    result["concurrent_tokens_per_s"] = {k: med(k, "concurrent_tokens_per_s") for k in runs}
    result["cpu_idle"] = {k: rs[0].get("cpu_idle", "halt") for k, rs in runs.items()}
    # the baseline of each ratio: the faster tp=1 of the same thread count
    base = {
        key: max((k for k in ("tp1", "tp1_poll") if k in runs), key=lambda k: med(k, key))
        for key in ("batch1_tokens_per_s", "concurrent_tokens_per_s")
    }
    result["baseline"] = base
    for peer in ran:
        result[f"vs_{peer}"] = {
            key: med(many, key) / med(peer, key)
            for key in ("batch1_tokens_per_s", "concurrent_tokens_per_s")
        }
        result[f"{peer}_same_tokens"] = all(
            r["batch1_tokens"] == runs[one][0]["batch1_tokens"] for r in runs[peer]
        )
    result["batch1_ratio"] = med(many, "batch1_tokens_per_s") / med(
        base["batch1_tokens_per_s"], "batch1_tokens_per_s"
    )
    result["concurrent_ratio"] = med(many, "concurrent_tokens_per_s") / med(
        base["concurrent_tokens_per_s"], "concurrent_tokens_per_s"
    )
    if idle:
        result["poll_vs_halt"] = {
            f"tp{n}": {
                key: med(poll, key) / med(halt, key)
                for key in ("batch1_tokens_per_s", "concurrent_tokens_per_s")
            }
            for n, poll, halt in ((1, "tp1_poll", "tp1"), (tp, many, f"tp{tp}_halt"))
        }
    result["vs_tp1_1thread"] = {
        key: med(many, key) / med("tp1_1thread", key)
        for key in ("batch1_tokens_per_s", "concurrent_tokens_per_s")
    }
    if gloo:
        result[f"vs_tp{tp}_gloo"] = {
            key: med(many, key) / med(f"tp{tp}_gloo", key)
            for key in ("batch1_tokens_per_s", "concurrent_tokens_per_s")
        }
    result["targets"] = {
        "batch1_ratio >= 0.8": result["batch1_ratio"] >= 0.8,
        "concurrent_ratio >= 1.0": result["concurrent_ratio"] >= 1.0,
    }
    plain = [k for k in contenders if not any(k.endswith(f"_{q}") for q in recipes)]
    result["same_tokens"] = all(
        r["batch1_tokens"] == runs[one][0]["batch1_tokens"] for k in plain for r in runs[k]
    )
    result["quantized"] = {
        q: {
            "batch1_ratio": med(f"tp{tp}_{q}", "batch1_tokens_per_s")
            / med(f"tp1_{q}", "batch1_tokens_per_s"),
            "concurrent_ratio": med(f"tp{tp}_{q}", "concurrent_tokens_per_s")
            / med(f"tp1_{q}", "concurrent_tokens_per_s"),
            "same_tokens": all(
                r["batch1_tokens"] == runs[f"tp1_{q}"][0]["batch1_tokens"]
                for k in (f"tp1_{q}", f"tp{tp}_{q}")
                for r in runs[k]
            ),
        }
        for q in recipes
    }
    for peer in ran:
        result["targets"][f"vs {PEERS[peer]} >= 1.0"] = min(result[f"vs_{peer}"].values()) >= 1
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
    for peer, name in PEERS.items():
        if f"vs_{peer}" in r:
            v = r[f"vs_{peer}"]
            lines.append(
                f"vs {name} tp={r['tp']}: batch-1 {v['batch1_tokens_per_s']:.2f}x, "
                f"concurrent {v['concurrent_tokens_per_s']:.2f}x (target >= 1.0); same "
                f"greedy tokens: {r[f'{peer}_same_tokens']}"
            )
        if f"{peer}_error" in r:
            lines.append(f"{name} did not run: {r[f'{peer}_error']}")
    base = r.get("baseline", {})
    lines.append(
        f"ratios: batch-1 {r['batch1_ratio']:.2f} (target >= 0.8, against "
        f"{base.get('batch1_tokens_per_s', 'tp1')}), concurrent {r['concurrent_ratio']:.2f} "
        f"(target >= 1.0, against {base.get('concurrent_tokens_per_s', 'tp1')}); same greedy "
        f"tokens: {r['same_tokens']}"
    )
    polled = [k for k, v in r.get("cpu_idle", {}).items() if v == "poll"]
    lines.append(f"idle cores poll (CPU latency QoS) in: {', '.join(polled) or 'none'}")
    for who, v in r.get("poll_vs_halt", {}).items():
        lines.append(
            f"{who} polling vs halting idle cores: batch-1 {v['batch1_tokens_per_s']:.2f}x, "
            f"concurrent {v['concurrent_tokens_per_s']:.2f}x"
        )
    if f"vs_tp{r['tp']}_gloo" in r:
        v = r[f"vs_tp{r['tp']}_gloo"]
        lines.append(
            f"point-to-point collectives vs gloo's at tp={r['tp']}: batch-1 "
            f"{v['batch1_tokens_per_s']:.2f}x, concurrent {v['concurrent_tokens_per_s']:.2f}x"
        )
    for q, v in r.get("quantized", {}).items():
        lines.append(
            f"{q} tp={r['tp']} / tp=1: batch-1 {v['batch1_ratio']:.2f}, concurrent "
            f"{v['concurrent_ratio']:.2f} (indicative); same greedy tokens: {v['same_tokens']}"
        )
    return "\n".join(lines)
