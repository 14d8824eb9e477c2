"""zserve under an open-loop load: Dynamic SplitFuse vs prefill-first continuous
batching vs static batching, plus prefix caching on a shared system prompt.

Workload (FastGen-style, stated so runs compare): Poisson arrivals at each rate;
prompt lengths a mix of short and long prompts, output lengths uniform, both drawn
from a seeded RNG (`--seed`), with the text taken from Shakespeare windows. Outputs
have exactly their drawn length (`ignore_eos`), greedy decoding. Every policy sees
the same requests at the same arrival times, in the same process, one after another.

The arrival clock is wall time while the engine steps in-process: before every step,
the requests whose arrival time has passed are added; latencies count from the
*scheduled* arrival, so time a request waits behind a busy step is charged to it.

Per policy and rate:
  * throughput: generated tokens/s over the run (first arrival to last token);
  * TTFT (arrival -> first token) and inter-token latency (ITL) p50/p95/p99;
  * effective throughput: requests/s that met the SLA, judged per token as the FastGen
    evaluation does (DeepSpeedExamples `benchmarks/inference/mii`,
    `plot_effective_throughput.py`): TTFT within a bound, and a generation rate held
    *throughout* the stream, not on average: the exponential moving average (span 16)
    of the inter-token latencies stays below 1/rate at every token (`effective_rps`,
    the headline), or, stricter, token i arrives within (i+1)/rate of the first
    (`effective_rps_cum`). Bounds are in units of one full token-budget forward measured
    at the start (see `run`).
The static baseline (transformers `generate` on padded batches) gets each token's
time as `generate` produced it (as if streamed), not the batch's end.

Prefix caching: `prefix_requests` chat requests share a long system prompt (~
`system_prompt_tokens` tokens) and differ in the question; they run one at a time
(so TTFT is the prefill alone), with and without prefix caching. The first request
of each run fills the cache and is reported apart.

Run: ``z bench serve MODEL_DIR [--rates 0.5,1.0,2.0] [--num-requests 12] --json``.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from zcore.bench import load
from zserve.config import EngineConfig
from zserve.engine import Engine
from zserve.sampling import SamplingParams

_models = load("_models", Path(__file__).parent)

summarize = load("_serve_sla", Path(__file__).parent).summarize

POLICIES = ("splitfuse", "prefill-first", "static")


def _corpus_tokens(tokenizer: Any, max_tokens: int = 60_000) -> list[int]:
    """A stream of real-text token ids (Shakespeare, via zstack's corpus reader)."""
    from ztrain.data import load_plays

    ids: list[int] = []
    for _, text in load_plays()[:4]:
        ids += tokenizer.encode(text[:200_000])
        if len(ids) >= max_tokens:
            break
    return ids[:max_tokens]


def make_workload(
    pool: list[int], n: int, rate: float, seed: int, dist: dict[str, Any]
) -> list[dict[str, Any]]:
    """n requests: Poisson arrivals at `rate`/s; a `long_fraction` of prompts drawn
    uniformly from `long_prompt`, the rest from `short_prompt`; outputs from `output`."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        lo, hi = (
            dist["long_prompt"] if rng.random() < dist["long_fraction"] else dist["short_prompt"]
        )
        plen = rng.randint(lo, hi)
        start = rng.randrange(0, len(pool) - plen)
        out.append(
            {
                "id": f"r{i}",
                "arrival": t,
                "prompt": pool[start : start + plen],
                "max_tokens": rng.randint(*dist["output"]),
            }
        )
    return out


def drive(engine: Any, workload: list[dict[str, Any]], max_run_s: float) -> dict[str, Any]:
    """Replay `workload` against `engine` on the wall clock; per-request token times."""
    pending = sorted(workload, key=lambda r: r["arrival"])
    recs = {
        r["id"]: {
            "arrival": r["arrival"],
            "prompt_tokens": len(r["prompt"]),
            "max_tokens": r["max_tokens"],
            "times": [],
        }
        for r in workload
    }
    static_times = getattr(engine, "token_times", None)
    t0 = time.perf_counter()
    i = 0
    timed_out = False
    while i < len(pending) or engine.has_unfinished():
        now = time.perf_counter() - t0
        if now > max_run_s:
            timed_out = True
            break
        while i < len(pending) and pending[i]["arrival"] <= now:
            r = pending[i]
            engine.add_request(
                r["id"],
                r["prompt"],
                SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True),
            )
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(pending[i]["arrival"] - now, 0.05)))
            continue
        outs = engine.step()
        done = time.perf_counter() - t0
        for o in outs:
            if static_times is not None and o.request_id in static_times:
                recs[o.request_id]["times"] += [t - t0 for t in static_times.pop(o.request_id)]
            else:
                recs[o.request_id]["times"] += [done] * len(o.token_ids)
    if timed_out:  # stop cleanly: whatever is unfinished misses the SLA
        for r in pending:
            engine.abort(r["id"])
    return {"records": recs, "timed_out": timed_out, "wall_s": time.perf_counter() - t0}


def _engines(model_dir: Path, policies: list[str], base: dict[str, Any]):
    """policy -> engine; the two continuous-batching policies share one runner."""
    shared = None
    for policy in policies:
        if policy == "static":
            from zserve.static_batch import StaticBatchEngine

            yield policy, StaticBatchEngine(model_dir, EngineConfig(policy="static", **base))
            continue
        cfg = EngineConfig(policy=policy, **base)
        if shared is None:
            shared = Engine(model_dir, cfg)
            yield policy, shared
        else:
            yield policy, Engine.from_parts(shared.runner, shared.tokenizer, cfg, shared.model_name)


def prefix_experiment(
    engine: Engine, pool_text: str, n: int, system_tokens: int, seed: int
) -> dict[str, Any]:
    """Sequential chat requests sharing a long system prompt: TTFT with/without caching."""
    tok = engine.tokenizer
    ids = tok.encode(pool_text)
    system = tok.decode(ids[:system_tokens])
    rng = random.Random(seed)
    words = pool_text.split()
    questions = [" ".join(rng.sample(words, 6)) + "?" for _ in range(n)]
    prompts = [
        tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": f"Explain: {q}"}]
        )
        for q in questions
    ]
    out: dict[str, Any] = {"requests": n, "prompt_tokens": len(tok.encode(prompts[0]))}
    for caching in (True, False):
        cfg = engine.config.model_copy(update={"prefix_caching": caching, "policy": "splitfuse"})
        e = Engine.from_parts(engine.runner, tok, cfg, engine.model_name)
        ttfts = []
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            e.add_request(f"p{i}", p, SamplingParams(max_tokens=1, temperature=0))
            while e.has_unfinished():
                e.step()
            ttfts.append(time.perf_counter() - t0)
        key = "with_cache" if caching else "without_cache"
        out[key] = {
            "first_ttft_s": ttfts[0],
            "median_ttft_s": statistics.median(ttfts[1:]),
            "prefix_hit_rate": e.stats()["prefix_hits"] / max(1, e.stats()["prefix_queries"]),
        }
    out["ttft_speedup"] = out["without_cache"]["median_ttft_s"] / out["with_cache"]["median_ttft_s"]
    return out


def _calibrate(engine: Engine, pool: list[int], token_budget: int) -> float:
    """Median seconds of one full `token_budget`-token forward: the SLA's time unit."""
    from zserve.runner import SeqChunk

    bs = engine.kv.block_size
    table = list(range(-(-token_budget // bs)))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        engine.runner.forward([SeqChunk(0, pool[:token_budget], 0, table)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(
    model_dir: str | None = None,
    policies: str = ",".join(POLICIES),
    rates: str = "0.5,1.0,2.0",
    num_requests: int = 12,
    seed: int = 0,
    token_budget: int = 64,
    max_num_seqs: int = 16,
    num_blocks: int = 1024,
    short_prompt: str = "8,48",
    long_prompt: str = "384,768",
    long_fraction: float = 0.25,
    output_len: str = "16,48",
    sla_ttft_units: float = 40.0,
    sla_rate_per_unit: float = 0.5,
    sla_ema_span: int = 16,
    prefix_requests: int = 6,
    system_prompt_tokens: int = 384,
    threads: int = 1,
    max_run_s: float = 120.0,
    compare: str | None = None,
    compare_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the workload at every rate against every policy; returns the JSON result.
    With ``compare="llama.cpp"``, runs `_serve_compare` instead (zserve vs llama-cpp-python).

    The SLA is stated in units of u = one full `token_budget` forward measured at the
    start (so it means the same on a loaded 2-core box and on a fast machine): a request
    meets it with TTFT <= `sla_ttft_units` u and a generation rate of
    `sla_rate_per_unit` / u tokens/s held at every token: the EMA (span `sla_ema_span`)
    of its inter-token latencies below u / `sla_rate_per_unit` (`met_sla`), or each token
    on its cumulative deadline (`met_sla_cum`), as FastGen's evaluation checks them.
    """
    mdir = Path(model_dir) if model_dir else _models.default_model_dir()
    if compare is not None:
        return load("_serve_compare", Path(__file__).parent).run_compare(
            mdir, peer=compare, threads=threads, **(compare_options or {})
        )
    pols = [p.strip() for p in policies.split(",") if p.strip()]
    bad = [p for p in pols if p not in POLICIES]
    if bad:
        raise ValueError(f"--policies {bad} unknown; choose from {', '.join(POLICIES)}")
    from zcore.bench import numbers

    rate_list = numbers("--rates", rates, float)
    if sla_ema_span < 1 or sla_rate_per_unit <= 0:
        raise ValueError(
            f"need sla_ema_span >= 1 and sla_rate_per_unit > 0 "
            f"(got {sla_ema_span}, {sla_rate_per_unit})"
        )
    if any(r <= 0 for r in rate_list) or num_requests < 1:
        raise ValueError(f"need rates > 0 and num_requests >= 1 (got {rates}, {num_requests})")

    def pair(flag: str, s: str) -> tuple[int, int]:
        a, b = numbers(flag, s, int, count=2)
        return a, b

    dist = {
        "short_prompt": pair("--short-prompt", short_prompt),
        "long_prompt": pair("--long-prompt", long_prompt),
        "long_fraction": long_fraction,
        "output": pair("--output-len", output_len),
    }
    torch.set_num_threads(threads)
    base = dict(
        token_budget=token_budget,
        max_num_seqs=max_num_seqs,
        num_blocks=num_blocks,
        prefix_caching=False,
    )  # scheduling alone; caching is measured on its own
    from zserve.tokenizer import Tokenizer

    pool = _corpus_tokens(Tokenizer(mdir))
    workloads = {
        r: make_workload(pool, num_requests, r, seed + k, dist) for k, r in enumerate(rate_list)
    }
    engines = dict(_engines(mdir, pols, base))
    for engine in engines.values():  # warm-up (first-call allocations), not measured
        drive(engine, make_workload(pool, 2, 100.0, seed + 99, dist), max_run_s)
    first = next((e for e in engines.values() if isinstance(e, Engine)), None)
    if first is None:
        first = Engine(mdir, EngineConfig(policy="splitfuse", **base))
    unit = _calibrate(first, pool, token_budget)
    sla = {
        "unit_s": unit,
        "ttft_s": sla_ttft_units * unit,
        "decode_tokens_per_s": sla_rate_per_unit / unit,
        "ema_span": sla_ema_span,
    }
    results: dict[str, dict[str, Any]] = {p: {} for p in pols}
    # Policies interleaved per rate, so each rate's contenders see the same machine load.
    for r in rate_list:
        for policy in pols:
            results[policy][str(r)] = summarize(
                drive(engines[policy], workloads[r], max_run_s), sla
            )
    prefix = None
    if prefix_requests > 1:
        from ztrain.data import load_plays

        text = dict(load_plays())["Hamlet"][:20_000]
        prefix = prefix_experiment(first, text, prefix_requests, system_prompt_tokens, seed)
    comparison = {}
    if "splitfuse" in results:
        for r in map(str, rate_list):
            sf = results["splitfuse"][r]
            row: dict[str, Any] = {}
            for other in ("prefill-first", "static"):
                if other in results:
                    o = results[other][r]
                    row[f"effective_vs_{other}"] = (
                        sf["effective_rps"] / o["effective_rps"] if o["effective_rps"] else None
                    )
                    row[f"effective_cum_vs_{other}"] = (
                        sf["effective_rps_cum"] / o["effective_rps_cum"]
                        if o["effective_rps_cum"]
                        else None
                    )
                    row[f"itl_p99_{other}_over_splitfuse"] = (
                        o["itl_s"]["p99"] / sf["itl_s"]["p99"]
                        if o["itl_s"]["p99"] and sf["itl_s"]["p99"]
                        else None
                    )
            comparison[r] = row
    return {
        "benchmark": "serve",
        "model": mdir.name,
        "workload": {
            "num_requests": num_requests,
            "rates_rps": rate_list,
            "seed": seed,
            "prompt_tokens": dist,
            "ignore_eos": True,
            "greedy": True,
        },
        "sla": sla,
        "engine": {
            "token_budget": token_budget,
            "max_num_seqs": max_num_seqs,
            "num_blocks": num_blocks,
            "prefix_caching": False,
        },
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores_usable": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(),
        },
        "results": results,
        "splitfuse_vs": comparison,
        "prefix_caching": prefix,
    }


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def report(result: dict[str, Any]) -> str:
    """Latency-vs-throughput table per policy and rate, then the prefix experiment."""
    if result.get("benchmark") == "serve-compare":
        return load("_serve_compare", Path(__file__).parent).report(result)
    sla = result["sla"]
    lines = [
        f"zserve open-loop benchmark on {result['model']} "
        f"({result['machine']['cores_usable']} cores, {result['machine']['torch_threads']} "
        f"torch threads)",
        f"SLA per request (u = one {result['engine']['token_budget']}-token forward = "
        f"{sla['unit_s']:.3f} s): TTFT <= {sla['ttft_s']:.2f} s and "
        f"{sla['decode_tokens_per_s']:.2f} tok/s held at every token "
        f"(EMA{sla['ema_span']} of inter-token latency; 'cum': every token on its deadline)",
        "",
        f"{'policy':<14}{'rate':>6}{'tok/s':>8}{'eff rps':>9}{'met':>6}{'cum':>6}"
        f"{'TTFT p50':>10}{'p95':>8}{'p99':>8}{'ITL p50':>9}{'p95':>8}{'p99':>8}",
    ]
    for policy, by_rate in result["results"].items():
        for rate, m in by_rate.items():
            t, i = m["ttft_s"], m["itl_s"]
            lines.append(
                f"{policy:<14}{rate:>6}{m['tokens_per_s']:>8.1f}{m['effective_rps']:>9.3f}"
                f"{m['met_sla']:>3}/{m['requests']:<2}{m['met_sla_cum']:>3}/{m['requests']:<2}"
                f"{_f(t['p50']):>10}{_f(t['p95']):>8}"
                f"{_f(t['p99']):>8}{_f(i['p50'], '{:.3f}'):>9}{_f(i['p95']):>8}"
                f"{_f(i['p99']):>8}" + ("  (timed out)" if m["timed_out"] else "")
            )
    if result.get("splitfuse_vs"):
        lines.append("")
        lines.append("splitfuse vs others (effective-throughput ratio; p99 ITL other/splitfuse):")
        for rate, row in result["splitfuse_vs"].items():
            parts = [f"{k}={_f(v)}" for k, v in row.items()]
            lines.append(f"  rate {rate}: " + ", ".join(parts))
    p = result.get("prefix_caching")
    if p:
        w, wo = p["with_cache"], p["without_cache"]
        lines += [
            "",
            f"prefix caching ({p['requests']} requests, ~{p['prompt_tokens']}-token prompts "
            "sharing a system prompt, one at a time):",
            f"  median TTFT without {wo['median_ttft_s']:.3f} s, with {w['median_ttft_s']:.3f}"
            f" s -> {p['ttft_speedup']:.1f}x (first request, cold: {w['first_ttft_s']:.3f} s;"
            f" hit rate {w['prefix_hit_rate']:.0%})",
        ]
    return "\n".join(lines)


if __name__ == "__main__":  # `python benchmarks/serve.py --rates=0.3,0.6 ...` (z bench is the CLI)
    import inspect
    import json
    import sys

    defaults = {k: v.default for k, v in inspect.signature(run).parameters.items()}
    opts: dict[str, Any] = {}
    for arg in sys.argv[1:]:
        key, _, val = arg.lstrip("-").partition("=")
        key = key.replace("-", "_")
        kind = type(defaults[key]) if defaults.get(key) is not None else str
        opts[key] = kind(val)
    res = run(**opts)
    print(report(res))
    print(json.dumps(res))
