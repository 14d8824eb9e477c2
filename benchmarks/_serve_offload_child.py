"""One contender of `z bench serve-offload`, run in a process of its own so that its peak
RSS is its own: ``python _serve_offload_child.py JSON`` prints one JSON line.

Contenders: ``zserve`` (resident, or under a weight budget from ``cpu`` / ``nvme``) and
``accelerate`` (transformers with ``device_map="auto"``, ``max_memory`` and an
``offload_folder``). Each serves batches of same-length prompts (no padding on either side)
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


def run_zserve(a: dict[str, Any]) -> dict[str, Any]:
    import torch

    import zserve
    from zserve.sampling import SamplingParams

    torch.set_num_threads(a["threads"])
    runtime = rss()["vmrss"]
    config: dict[str, Any] = {
        "max_model_len": a["prompt_len"] + a["max_tokens"] + 8,
        "max_num_seqs": max(a["batches"]),
        "token_budget": max(256, max(a["batches"]) * a["prompt_len"]),
        "num_blocks": max(a["batches"]) * (-(-(a["prompt_len"] + a["max_tokens"] + 8) // 16)),
    }
    if a.get("budget"):
        config |= {
            "weights_budget": a["budget"],
            "offload": a["offload"],
            "prefetch_layers": a.get("prefetch", 1),
        }
        if a["offload"] == "nvme":
            config["offload_dir"] = a["offload_dir"]
    t0 = time.perf_counter()
    engine = zserve.pipeline(a["model_dir"], **config).engine
    load_s = time.perf_counter() - t0
    model, stream = engine.runner.model, engine.runner.model.stream
    prompts = a["prompts"]
    rid = 0

    def serve(batch: int, tokens: int) -> tuple[list[float], list[float]]:
        nonlocal rid
        params = SamplingParams(max_tokens=tokens, temperature=0)
        for p in prompts[:batch]:
            engine.add_request(f"r{rid}", p, params)
            rid += 1
        started: set[str] = set()
        steps, io = [], []
        while engine.has_unfinished():
            decode = len(started) == batch
            w0 = 0.0 if stream is None else stream.io_wait_s
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            if decode:
                steps.append(dt)
                io.append(0.0 if stream is None else stream.io_wait_s - w0)
            started |= {o.request_id for o in outs if o.token_ids}
        return steps, io

    serve(1, 3)  # warm-up
    results = []
    for b in a["batches"]:
        steps, io = serve(b, a["max_tokens"] + 1)
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


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    fn = {"zserve": run_zserve, "accelerate": run_accelerate}[args["who"]]
    print(json.dumps(fn(args)))
