"""zserve under a weight budget (ZeRO-Inference) against the resident server, same run.

SmolLM2-135M by default, a budget of a quarter of its decoder-layer weights, the rest
streamed from a swap file read with O_DIRECT (``--offload nvme``) or from host memory.
Every contender runs in a process of its own (`_serve_offload_child.py`), so its peak RSS
(VmHWM) is its own; each serves ``batches`` of same-length Shakespeare prompts greedily and
times the decode steps after every prompt's first token. The speeds compared with the
resident server come from one more process holding both zserve engines, which take turns
batch by batch for ``reps`` rounds: on a shared machine the load then falls on both alike.

Reported per batch: tokens/s, the median step (a token's latency at that batch), the
IO-wait share of step time (time the compute thread waited on a fetch not yet done). From
the same run: the disk's O_DIRECT read rate (a file as large as one forward's stream, read
in layer-sized requests on the same engine settings), the bytes streamed per token
(streamed bytes per forward / batch), the resulting limit ``batch x disk rate / streamed
bytes per forward`` and the share of it reached (target >= 0.85 at batch 16). Where the
resident server of the same run is slower than that limit the machine's compute is the
nearer ceiling: ``bound_by`` names it and ``share_of_bound`` is the share of the nearer one. Peak RSS is
set against budget + KV cache + the weights outside the budget (embedding / head) + the
runtime's own RSS before loading (torch, the libraries): the remainder is the stated
overhead.

Peers in the same run when installed beside: transformers + accelerate with
``device_map="auto"``, ``max_memory`` of the same weight bytes (budget + embedding/head) and
an ``offload_folder``; llama-cpp-python on the F32 GGUF with ``use_mmap``, inside a memory
cgroup (made under this process's own and removed by the run, `_memcg.py`) limited to its
runtime RSS + the same weight bytes + ``LLAMACPP_HEADROOM``, the GGUF's cached pages dropped
first; it serves one request after another (``Llama`` holds one sequence), and its
``read_bytes_per_token`` shows what it re-reads. A peer that cannot run here says why in
``peers``.

Run: ``z bench serve-offload [--budget 1/4|SIZE] [--offload nvme|cpu] [--offload-dir DIR]``.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from zcore.bench import load

_models = load("_models", Path(__file__).parent)

CHILD = Path(__file__).resolve().parent / "_serve_offload_child.py"


def _layer_bytes(model_dir: Path) -> tuple[int, int]:
    """(decoder-layer bytes, other weight bytes) of the checkpoint as stored."""
    from safetensors import safe_open

    layers = other = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                t = st.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                size = n * {"F32": 4, "BF16": 2, "F16": 2}.get(t.get_dtype(), 1)
                if name.startswith("model.layers."):
                    layers += size
                else:
                    other += size
    return layers, other


def disk_read_rate(directory: str, nbytes: int, request: int) -> dict[str, Any]:
    """GB/s of O_DIRECT reads of a fresh ``nbytes`` file in ``request``-byte requests on the
    engine settings of the swap store (1 MiB pieces, depth 16), with 1 and with 4 requests
    in flight (the stream keeps up to ``prefetch + 1``); ``gb_per_s`` is the best seen."""
    import torch

    import znative

    path = Path(directory) / f"zserve-bench-read-{os.getpid()}.bin"
    aio = znative.AioHandle(block_size=1 << 20, queue_depth=16)
    bufs = [torch.from_numpy(znative.aligned_buffer(request)) for _ in range(4)]
    bufs[0].fill_(7)
    offsets = list(range(0, nbytes, request))
    try:
        for off in offsets:
            aio.sync_pwrite(bufs[0].numpy(), str(path), off)
        rates: dict[str, list[float]] = {"in_flight_1": [], "in_flight_4": []}
        for _ in range(2):
            for depth, key in ((1, "in_flight_1"), (4, "in_flight_4")):
                t0 = time.perf_counter()
                pending: list[int] = []
                for k, off in enumerate(offsets):
                    if len(pending) == depth:
                        aio.wait(pending.pop(0))
                    pending.append(aio.pread(bufs[k % depth].numpy(), str(path), off))
                for rid in pending:
                    aio.wait(rid)
                rates[key].append(len(offsets) * request / (time.perf_counter() - t0) / 1e9)
        stats = aio.stats()
    finally:
        path.unlink(missing_ok=True)
    return {
        "gb_per_s": max(max(v) for v in rates.values()),
        "runs_gb_per_s": rates,
        "file_bytes": len(offsets) * request,
        "request_bytes": request,
        "engine": {k: stats[k] for k in ("direct", "direct_refused", "bounced")},
    }


def _request(model: Path, layer_bytes: int) -> int:
    """One layer's bytes, in whole 4096-byte blocks (the stream's request size)."""
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    return -(-layer_bytes // layers // 4096) * 4096


def _child(args: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    try:
        out = subprocess.run(
            [sys.executable, str(CHILD), json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "?"}
    return json.loads(out.stdout.strip().splitlines()[-1])


LLAMACPP_HEADROOM = 64 << 20
"""What llama.cpp may hold above its runtime and the weight bytes: its KV cache and compute
buffers at these context sizes (a few MiB) with room to spare."""


def _llama_cpp(base: dict[str, Any], weights: int, timeout_s: float) -> dict[str, Any]:
    """llama.cpp on the F32 GGUF with ``use_mmap`` in a memory cgroup of the same weight
    bytes as the others (budget + embedding/head), made and removed here."""

    here = Path(__file__).resolve().parent
    lcpp, memcg = load("_llamacpp", here), load("_memcg", here)
    status = lcpp.status()
    if not status["available"]:
        return {"ran": False, "why": status["install"]}
    cache = Path.home() / ".cache" / "zstack" / "gguf"
    ggufs, made = lcpp.gguf_files(cache, ["F32"], base["threads"])
    group, why = memcg.make()
    if group is None:
        return {"ran": False, "why": why}
    try:
        args = {
            **base,
            "who": "llama.cpp",
            "gguf": str(ggufs["F32"]),
            "cgroup": str(group),
            "max_memory": weights,
            "headroom": LLAMACPP_HEADROOM,
        }
        out = _child(args, timeout_s)
        cgroup = memcg.stats(group)
    finally:
        memcg.remove(group)
    return {
        "ran": "error" not in out,
        "version": status["version"],
        "made_s": made,
        **out,
        "cgroup": cgroup,
    }


def run(
    model_dir: str | None = None,
    budget: str = "1/4",
    offload: str = "nvme",
    offload_dir: str | None = None,
    batches: str = "1,16",
    prompt_len: int = 16,
    max_tokens: int = 8,
    threads: int = 2,
    prefetch: int = 1,
    reps: int = 2,
    peers: str = "accelerate,llama.cpp",
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Resident vs offloaded zserve (and the peers) on one machine, one run."""
    model = Path(model_dir) if model_dir else _models.default_model_dir()
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"no model at `{model}`; run `make setup` or pass MODEL_DIR")
    if offload not in ("cpu", "nvme"):
        raise ValueError(f"offload {offload!r}: use `cpu` or `nvme`")
    layer_bytes, other_bytes = _layer_bytes(model)
    if "/" in budget:
        num, den = budget.split("/")
        budget_bytes = layer_bytes * int(num) // int(den)
    else:
        from zserve.offload import parse_size

        budget_bytes = parse_size(budget)
    sizes = [int(b) for b in batches.split(",")]
    own_dir = offload_dir is None
    work = Path(tempfile.mkdtemp(prefix="zserve-offload-bench-", dir=offload_dir or "/tmp"))
    try:
        base = {
            "model_dir": str(model),
            "prompts": _models.shakespeare_prompts(model, max(sizes), prompt_len),
            "batches": sizes,
            "prompt_len": prompt_len,
            "max_tokens": max_tokens,
            "threads": threads,
        }
        resident = _child({**base, "who": "zserve"}, timeout_s)
        ours = _child(
            {
                **base,
                "who": "zserve",
                "budget": budget_bytes,
                "offload": offload,
                "offload_dir": str(work),
                "prefetch": prefetch,
            },
            timeout_s,
        )
        inter = _child(
            {
                **base,
                "who": "interleaved",
                "budget": budget_bytes,
                "offload": offload,
                "offload_dir": str(work),
                "prefetch": prefetch,
                "reps": reps,
            },
            timeout_s,
        )
        stream = ours.get("stream", {})
        streamed = int(stream.get("streamed_bytes_per_forward", 0))
        disk = disk_read_rate(str(work), max(streamed, 64 << 20), _request(model, layer_bytes))
        result_peers: dict[str, Any] = {}
        wanted = [p for p in peers.split(",") if p]
        if "accelerate" in wanted:
            acc = _child(
                {
                    **base,
                    "who": "accelerate",
                    "max_memory": budget_bytes + other_bytes,
                    "offload_dir": str(work / "accelerate"),
                },
                timeout_s,
            )
            result_peers["accelerate"] = {"ran": "error" not in acc, **acc}
        if "llama.cpp" in wanted:
            result_peers["llama.cpp"] = _llama_cpp(base, budget_bytes + other_bytes, timeout_s)
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
    return _assemble(locals())


def _assemble(v: dict[str, Any]) -> dict[str, Any]:
    """The JSON object: contenders, the disk limit and its share, RSS against the budget."""
    ours, resident, disk, inter = v["ours"], v["resident"], v["disk"], v["inter"]
    streamed = int(ours.get("stream", {}).get("streamed_bytes_per_forward", 0))
    # speeds from the interleaved process (same load on both); the single-engine processes'
    # own timings stay in `ours` / `resident`
    ours_runs = inter.get("ours", ours.get("runs", []))
    resident_runs = inter.get("resident", resident.get("runs", []))
    rows = []
    for i, run_ in enumerate(ours_runs):
        b = run_["batch"]
        limit = b * disk["gb_per_s"] * 1e9 / streamed if streamed else None
        res = resident_runs[i] if i < len(resident_runs) else {}
        row = {
            **run_,
            "bytes_streamed_per_token": streamed / b,
            "disk_limit_tokens_per_s": limit,
            "share_of_disk_limit": run_["tokens_per_s"] / limit if limit else None,
            "resident_tokens_per_s": res.get("tokens_per_s"),
            "resident_step_ms_median": res.get("step_ms_median"),
            "vs_resident": run_["tokens_per_s"] / res["tokens_per_s"] if res else None,
        }
        if limit and res:  # the nearer ceiling: the disk, or this machine's compute
            bound = min(limit, res["tokens_per_s"])
            row["bound_tokens_per_s"] = bound
            row["bound_by"] = "disk" if limit <= res["tokens_per_s"] else "compute"
            row["share_of_bound"] = run_["tokens_per_s"] / bound
        for name, peer in v["result_peers"].items():
            if peer.get("ran"):
                p = peer["runs"][i]
                row[f"{name}_tokens_per_s"] = p["tokens_per_s"]
                row[f"vs_{name}"] = run_["tokens_per_s"] / p["tokens_per_s"]
        rows.append(row)
    rss = {}
    if "vmhwm" in ours:
        held = ours["stream"]["held_bytes"]
        accounted = held + ours["kv_cache_bytes"] + ours["non_layer_weights_bytes"]
        rss = {
            "peak_rss": ours["vmhwm"],
            "budget": v["budget_bytes"],
            "held_layer_bytes": held,
            "kv_cache_bytes": ours["kv_cache_bytes"],
            "non_layer_weights_bytes": ours["non_layer_weights_bytes"],
            "runtime_rss_before_load": ours["runtime_rss"],
            "overhead": ours["vmhwm"] - accounted - ours["runtime_rss"],
            "resident_peak_rss": resident.get("vmhwm"),
        }
    last = rows[-1] if rows else {}
    return {
        "benchmark": "serve_offload",
        "model": str(v["model"]),
        "offload": v["offload"],
        "budget_bytes": v["budget_bytes"],
        "layer_weights_bytes": v["layer_bytes"],
        "other_weights_bytes": v["other_bytes"],
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": v["threads"],
        "load_avg": os.getloadavg(),
        "disk": v["disk"],
        "rows": rows,
        "rss": rss,
        "target": {
            "share_of_disk_limit_at_largest_batch": 0.85,
            "reached": last.get("share_of_disk_limit"),
        },
        "interleaved": inter,
        "ours": ours,
        "resident": resident,
        "peers": v["result_peers"],
    }


def report(r: dict[str, Any]) -> str:
    gb = r["disk"]["gb_per_s"]
    lines = [
        f"serve-offload {r['offload']}: budget {r['budget_bytes'] / 2**20:.0f} MiB of "
        f"{r['layer_weights_bytes'] / 2**20:.0f} MiB layer weights; disk O_DIRECT {gb:.2f} GB/s",
        "batch  tok/s  step_ms  io_wait  limit  share  resident  bound  " + "  ".join(r["peers"]),
    ]
    for row in r["rows"]:
        peer = "  ".join(f"{row.get(f'{n}_tokens_per_s', float('nan')):.2f}" for n in r["peers"])
        lines.append(
            f"{row['batch']:5d} {row['tokens_per_s']:6.2f} {row['step_ms_median']:8.1f} "
            f"{row.get('io_wait_share', 0):7.2f} {row['disk_limit_tokens_per_s'] or 0:6.2f} "
            f"{row['share_of_disk_limit'] or 0:6.2f} {row['resident_tokens_per_s'] or 0:9.2f}  "
            f"{row.get('bound_by', '?')}:{row.get('share_of_bound', 0):.2f}  " + peer
        )
    if r["rss"]:
        s = {k: v / 2**20 for k, v in r["rss"].items() if isinstance(v, int)}
        lines.append(
            f"peak RSS {s['peak_rss']:.0f} MiB = budget-held {s['held_layer_bytes']:.0f} + KV "
            f"{s['kv_cache_bytes']:.0f} + embedding/head {s['non_layer_weights_bytes']:.0f} + "
            f"runtime {s['runtime_rss_before_load']:.0f} + overhead {s['overhead']:.0f} MiB"
        )
    for name, p in r["peers"].items():
        if not p.get("ran"):
            lines.append(f"{name}: not run: {p.get('why') or p.get('error')}")
    return "\n".join(lines)
