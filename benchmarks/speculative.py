"""Speculative decoding in zserve: plain greedy decoding vs n-gram prompt lookup vs the
layer-truncated self-draft, on the same prompts, in the same process, one after another.

Workloads (greedy, `ignore_eos`, every output exactly `max_tokens` long):
  * `copy`: a Shakespeare passage, a line saying it is copied out next, and its first
    60 characters: the model continues the copy, so the output quotes the input (the
    case prompt lookup is for: summaries, edits, retrieval-grounded answers);
  * `chat`: short chat questions; little of the output is in the prompt.
Each workload runs at each concurrency (`max_num_seqs`: 1 is the latency-bound
single-stream case speculative decoding targets; larger batches leave the forward less
idle). The three engines share one model runner (one load); each mode runs after an
untimed warm-up request.

Per workload, concurrency and mode: generated tokens/s (wall time of the whole run),
engine steps (target forwards), tokens through the target, draft tokens proposed and
accepted, the acceptance rate, mean accepted drafts per verify step, speedup over plain
(tokens/s ratio), and whether the outputs equal plain decoding's token for token
(`ok` is false otherwise, and `z bench` exits 1).

With `--temperature T` > 0 the requests sample (unseeded: a seeded request is not
speculated) and drafts go through speculative sampling's acceptance; outputs then differ
from plain decoding's run to run by design, so `identical_to_plain` is null and `ok`
does not check it (the distribution is checked in tests/zserve/test_speculative_units.py).

Run: ``z bench speculative [MODEL_DIR] [--modes plain,ngram,self-draft] --json``.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from zcore.bench import load
from zserve.config import EngineConfig
from zserve.engine import Engine
from zserve.sampling import SamplingParams

_models = load("_models", Path(__file__).parent)

MODES = ("plain", "ngram", "self-draft")


def _passages(n: int, chars: int) -> list[str]:
    """n Shakespeare windows of about `chars` characters, from different plays."""
    from ztrain.data import load_plays

    plays = load_plays()
    out = []
    for i in range(n):
        _, text = plays[i % len(plays)]
        start = len(text) // 3 + 997 * i
        start = text.index("\n", start) + 1  # begin on a line
        out.append(text[start : start + chars])
    return out


CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain what a binary search is.",
    "Write a short poem about the sea.",
    "How do plants make food?",
    "What causes the seasons on Earth?",
    "Name some uses of a paperclip.",
    "Why is the sky blue?",
)


def workloads(tokenizer: Any, names: list[str], num_prompts: int) -> dict[str, list[str]]:
    """Prompts per workload name (`copy`, `chat`)."""
    out = {}
    for name in names:
        if name == "copy":
            # The passage, then its first line again: the model goes on copying (the
            # 135M instruct model does not follow a "repeat this" instruction).
            out[name] = [
                f"{p}\n\nThe same passage, copied out:\n\n{p[:60]}"
                for p in _passages(num_prompts, 320)
            ]
        elif name == "chat":
            qs = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(num_prompts)]
            out[name] = [
                tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in qs
            ]
        else:
            raise ValueError(f"--workloads: {name!r} is not a workload; use copy and/or chat")
    return out


def generate(
    engine: Engine, prompts: list[str], max_tokens: int, temperature: float = 0.0
) -> tuple[list, float]:
    """Every prompt to completion; (token ids per prompt, wall seconds)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    out: dict[str, list[int]] = {f"q{i}": [] for i in range(len(prompts))}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return [out[f"q{i}"] for i in range(len(prompts))], time.perf_counter() - t0


def _counters(engine: Engine) -> dict[str, float]:
    s = engine.stats()
    keys = (
        "num_steps",
        "num_forward_tokens",
        "spec_proposed_tokens",
        "spec_accepted_tokens",
        "spec_verify_steps",
    )
    return {k: float(s.get(k, 0)) for k in keys}


def run(
    model_dir: str | None = None,
    modes: str = "plain,ngram,self-draft",
    workloads_: str = "copy,chat",
    concurrency: str = "1,4",
    num_prompts: int = 4,
    max_tokens: int = 32,
    num_speculative_tokens: int = 4,
    prompt_lookup_max: int = 4,
    prompt_lookup_min: int = 2,
    draft_layers: int | None = None,
    token_budget: int = 256,
    threads: int = 1,
    temperature: float = 0.0,
) -> dict[str, Any]:
    from zcore.bench import numbers

    mdir = Path(model_dir) if model_dir else _models.default_model_dir()
    if not (mdir / "config.json").is_file():
        raise FileNotFoundError(f"no model at {mdir}; run `make setup` or pass MODEL_DIR")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in mode_list if m not in MODES]
    if bad or not mode_list:
        raise ValueError(f"--modes {modes!r}: unknown {bad}; use some of {', '.join(MODES)}")
    if "plain" not in mode_list:
        mode_list.insert(0, "plain")  # the baseline every speedup is over
    conc = numbers("--concurrency", concurrency)
    if not 0 <= temperature <= 100:
        raise ValueError(f"--temperature {temperature}: give a number in [0, 100] (0: greedy)")
    greedy = SamplingParams(temperature=temperature).greedy
    torch.set_num_threads(threads)

    base = dict(token_budget=token_budget, num_blocks=512, block_size=16, prefix_caching=False)
    first = Engine(mdir, EngineConfig(**base))
    runner, tok = first.runner, first.tokenizer
    layers = len(runner.model.layers)
    draft_layers = draft_layers or max(1, layers - max(1, layers // 8))  # the engine's default
    spec_cfg = {
        "plain": {},
        "ngram": dict(
            speculative="ngram",
            prompt_lookup_max=prompt_lookup_max,
            prompt_lookup_min=prompt_lookup_min,
        ),
        "self-draft": dict(speculative="self-draft", draft_layers=draft_layers),
    }
    work = workloads(tok, [w.strip() for w in workloads_.split(",") if w.strip()], num_prompts)

    results: dict[str, Any] = {}
    ok = True
    for wname, prompts in work.items():
        for c in conc:
            rows: dict[str, Any] = {}
            ref: list | None = None
            for mode in mode_list:
                cfg = EngineConfig(
                    **base,
                    max_num_seqs=c,
                    num_speculative_tokens=num_speculative_tokens,
                    **spec_cfg[mode],
                )
                engine = Engine.from_parts(runner, tok, cfg, mdir.name)
                generate(engine, prompts[:1], 4)  # warm-up, untimed
                before = _counters(engine)
                outs, wall = generate(engine, prompts, max_tokens, temperature)
                d = {k: v - before[k] for k, v in _counters(engine).items()}
                n_tok = sum(map(len, outs))
                ref = outs if mode == "plain" else ref
                same = outs == ref if greedy else None
                ok &= bool(same) or not greedy
                proposed, accepted = d["spec_proposed_tokens"], d["spec_accepted_tokens"]
                rows[mode] = {
                    "wall_s": wall,
                    "tokens": n_tok,
                    "tokens_per_s": n_tok / wall,
                    "target_forwards": int(d["num_steps"]),
                    "target_tokens": int(d["num_forward_tokens"]),
                    "proposed": int(proposed),
                    "accepted": int(accepted),
                    "acceptance_rate": accepted / proposed if proposed else None,
                    "mean_accepted_per_step": (
                        accepted / d["spec_verify_steps"] if d["spec_verify_steps"] else None
                    ),
                    "identical_to_plain": same,
                }
            for row in rows.values():
                row["speedup"] = row["tokens_per_s"] / rows["plain"]["tokens_per_s"]
            results[f"{wname}/c{c}"] = rows
    return {
        "benchmark": "speculative",
        "model": mdir.name,
        "model_layers": layers,
        "ok": ok,
        "workload": {
            "workloads": list(work),
            "num_prompts": num_prompts,
            "max_tokens": max_tokens,
            "concurrency": conc,
            "greedy": greedy,
            "temperature": temperature,
            "ignore_eos": True,
        },
        "speculative": {
            "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_max": prompt_lookup_max,
            "prompt_lookup_min": prompt_lookup_min,
            "draft_layers": draft_layers,
        },
        "engine": {**base, "dtype": "float32", "device": "cpu"},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores_usable": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(),
        },
        "results": results,
    }


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def report(result: dict[str, Any]) -> str:
    lines = [
        f"speculative decoding, {result['model']} ({result['model_layers']} layers), "
        f"k={result['speculative']['num_speculative_tokens']}, "
        f"self-draft {result['speculative']['draft_layers']} layers",
        f"{'workload':<10} {'mode':<11} {'tok/s':>7} {'speedup':>7} {'fwds':>5} "
        f"{'accept':>6} {'acc/step':>8} same",
    ]
    for key, rows in result["results"].items():
        for mode, r in rows.items():
            lines.append(
                f"{key:<10} {mode:<11} {r['tokens_per_s']:>7.1f} {r['speedup']:>7.2f} "
                f"{r['target_forwards']:>5} {_f(r['acceptance_rate']):>6} "
                f"{_f(r['mean_accepted_per_step']):>8} {r['identical_to_plain']}"
            )
    if not result["workload"]["greedy"]:
        t = result["workload"]["temperature"]
        lines.append(f"sampled at temperature {t}: outputs not compared (they vary by design)")
    else:
        lines.append("outputs identical to plain decoding: " + ("yes" if result["ok"] else "NO"))
    return "\n".join(lines)
