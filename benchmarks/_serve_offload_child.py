"""One contender of `z bench serve-offload`, run in a process of its own so that its peak
RSS is its own: ``python _serve_offload_child.py JSON`` prints one JSON line.

Contenders: ``zserve`` (resident, or under a weight budget from ``cpu`` / ``nvme``: its
peak RSS), ``interleaved`` (both zserve engines in one process taking turns batch by batch:
their speeds under the same load), ``accelerate`` (transformers with
``device_map="auto"``, ``max_memory`` and an ``offload_folder``) and ``llama.cpp``
(llama-cpp-python on an F32 GGUF with ``use_mmap``, inside a memory cgroup whose limit is
its own runtime RSS + the weight bytes + a stated headroom). Each serves batches of same-length prompts (no padding on either side)
greedily; the decode steps after every prompt's first token are timed one by one.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any


def rss() -> dict[str, int]:
    """VmRSS and VmHWM (peak) of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, kb = line.split()[:2]
                out[key[:-1].lower()] = int(kb) * 1024
    return out


def _summary(steps: list[float], batch: int, io: list[float] | None) -> dict[str, Any]:
    total = sum(steps)
    out = {
        "batch": batch,
        "decode_steps": len(steps),
        "tokens_per_s": batch * len(steps) / total,
        "step_ms_median": 1e3 * statistics.median(steps),
        "step_ms_mean": 1e3 * total / len(steps),
    }
    if io is not None:
        out["io_wait_share"] = sum(io) / total
    return out


def _engine(a: dict[str, Any], offloaded: bool) -> tuple[Any, float]:
    """A zserve engine for the run (under the budget when ``offloaded``); its load seconds."""
    import zserve

    config: dict[str, Any] = {
        "max_model_len": a["prompt_len"] + a["max_tokens"] + 8,
        "max_num_seqs": max(a["batches"]),
        "token_budget": max(256, max(a["batches"]) * a["prompt_len"]),
        "num_blocks": max(a["batches"]) * (-(-(a["prompt_len"] + a["max_tokens"] + 8) // 16)),
    }
    if offloaded:
        config |= {
            "weights_budget": a["budget"],
            "offload": a["offload"],
            "prefetch_layers": a.get("prefetch", 1),
        }
        if a["offload"] == "nvme":
            config["offload_dir"] = a["offload_dir"]
    t0 = time.perf_counter()
    engine = zserve.pipeline(a["model_dir"], **config).engine
    return engine, time.perf_counter() - t0


def _serve(engine: Any, prompts: list[list[int]], tokens: int) -> tuple[list[float], list[float]]:
    """``prompts`` served at once: each decode step's seconds (after every prompt's first
    token) and the seconds of it spent waiting on a fetch."""
    from zserve.sampling import SamplingParams

    stream = engine.runner.model.stream
    params = SamplingParams(max_tokens=tokens, temperature=0)
    ids = [f"r{engine.num_steps}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    started: set[str] = set()
    steps, io = [], []
    while engine.has_unfinished():
        decode = len(started) == len(prompts)
        w0 = 0.0 if stream is None else stream.io_wait_s
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if decode:
            steps.append(dt)
            io.append(0.0 if stream is None else stream.io_wait_s - w0)
        started |= {o.request_id for o in outs if o.token_ids}
    return steps, io


def run_zserve(a: dict[str, Any]) -> dict[str, Any]:
    """One engine in this process: its peak RSS against what it holds (and its speed)."""
    import torch

    torch.set_num_threads(a["threads"])
    runtime = rss()["vmrss"]
    engine, load_s = _engine(a, bool(a.get("budget")))
    model, stream = engine.runner.model, engine.runner.model.stream
    _serve(engine, a["prompts"][:1], 3)  # warm-up
    results = []
    for b in a["batches"]:
        steps, io = _serve(engine, a["prompts"][:b], a["max_tokens"] + 1)
        results.append(_summary(steps, b, io if stream is not None else None))
    embed = model.embed.numel() * model.embed.element_size()
    head = 0 if model.lm_head is model.embed else model.lm_head.numel() * 4
    out = {
        "load_s": load_s,
        "runs": results,
        "runtime_rss": runtime,
        "kv_cache_bytes": engine.runner.num_blocks * engine.runner.kv_bytes_per_block(),
        "non_layer_weights_bytes": embed + head,
        **rss(),
    }
    if stream is not None:
        out["stream"] = stream.stats()
        if hasattr(stream.store, "stats"):
            out["aio"] = stream.store.stats()
    return out


def run_interleaved(a: dict[str, Any]) -> dict[str, Any]:
    """The resident and the offloaded engine in one process, taking turns batch by batch
    (``reps`` rounds): their speeds under the same load of a shared machine."""
    import torch

    torch.set_num_threads(a["threads"])
    engines = {"resident": _engine(a, False)[0], "ours": _engine(a, True)[0]}
    steps: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for engine in engines.values():
        _serve(engine, a["prompts"][:1], 3)  # warm-up
    for _ in range(a.get("reps", 2)):
        for b in a["batches"]:
            for name, engine in engines.items():
                s, io = _serve(engine, a["prompts"][:b], a["max_tokens"] + 1)
                got = steps.setdefault((name, b), ([], []))
                got[0].extend(s)
                got[1].extend(io)
    return {
        name: [
            _summary(steps[(name, b)][0], b, steps[(name, b)][1] if name == "ours" else None)
            for b in a["batches"]
        ]
        for name in engines
    }


def run_accelerate(a: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    torch.set_num_threads(a["threads"])
    runtime = rss()["vmrss"]
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        a["model_dir"],
        dtype=torch.float32,
        device_map="auto",
        max_memory={"cpu": a["max_memory"]},
        offload_folder=a["offload_dir"],
    ).eval()
    load_s = time.perf_counter() - t0
    devices = sorted({str(d) for d in getattr(model, "hf_device_map", {}).values()})

    class Clock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def serve(batch: int, tokens: int) -> list[float]:
        ids = torch.tensor(a["prompts"][:batch])
        clock = Clock()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                stopping_criteria=StoppingCriteriaList([clock]),
                pad_token_id=0,
            )
        return [b - a_ for a_, b in zip(clock.times, clock.times[1:], strict=False)]

    serve(1, 2)
    results = [_summary(serve(b, a["max_tokens"] + 1), b, None) for b in a["batches"]]
    return {"load_s": load_s, "runs": results, "runtime_rss": runtime, "devices": devices, **rss()}


def _read_bytes() -> int:
    """Bytes this process has caused to be read from storage (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def run_llamacpp(a: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp inside the memory cgroup ``a["cgroup"]``: the limit is set here, after the
    runtime is loaded, to its RSS + ``max_memory`` + ``headroom``; the GGUF's cached pages
    are dropped first so that its pages are read (and charged) inside the group."""
    import os
    from pathlib import Path

    from zcore.bench import load

    here = Path(__file__).resolve().parent
    lcpp, memcg = load("_llamacpp", here), load("_memcg", here)
    import llama_cpp

    runtime = rss()["vmrss"]
    group = Path(a["cgroup"])
    limit = runtime + a["max_memory"] + a["headroom"]
    memcg.set_limit(group, limit)
    memcg.join(group)
    fd = os.open(a["gguf"], os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    n_ctx = a["prompt_len"] + a["max_tokens"] + 8
    t0 = time.perf_counter()
    peer = lcpp.LlamaCppPeer(
        Path(a["gguf"]), threads=a["threads"], n_ctx=n_ctx, n_batch=max(32, a["prompt_len"])
    )
    load_s = time.perf_counter() - t0
    peer.generate(a["prompts"][0], 3)  # warm-up
    results = []
    for b in a["batches"]:
        # One sequence at a time (what `Llama` serves): its rate is the same at any batch, so
        # at most `peer_requests` of the batch's requests are timed (re-reading the model
        # for every token, 16 of them would take many minutes).
        served = a["prompts"][: min(b, a.get("peer_requests", 2))]
        read0, steps, tokens = _read_bytes(), 0.0, 0
        for prompt in served:
            r = peer.generate(prompt, a["max_tokens"] + 1)
            steps += r["last"] - r["first"]
            tokens += int(r["tokens"]) - 1
        results.append(
            {
                "batch": b,
                "requests_timed": len(served),
                "decode_tokens": tokens,
                "tokens_per_s": tokens / steps,
                "read_bytes_per_token": (_read_bytes() - read0) / max(1, tokens),
                "served": "one request after another (llama_cpp.Llama holds one sequence)",
            }
        )
    return {
        "load_s": load_s,
        "runs": results,
        "runtime_rss": runtime,
        "limit_bytes": limit,
        "headroom_bytes": a["headroom"],
        "gguf": a["gguf"],
        "gguf_bytes": os.path.getsize(a["gguf"]),
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        **rss(),
    }


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    fn = {
        "zserve": run_zserve,
        "interleaved": run_interleaved,
        "accelerate": run_accelerate,
        "llama.cpp": run_llamacpp,
    }[args["who"]]
    print(json.dumps(fn(args)))
