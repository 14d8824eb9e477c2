"""zchat's hybrid engine: rollout generation on zserve's paged-KV runner vs transformers'
``generate``, on the same actor weights, in the same process, one after another.

The actor is SmolLM2-135M-Instruct built as PPO builds it: ``zcore.hf.from_pretrained`` into
ZeRO-3 partitions and ``zcore.initialize`` (one process here, so the partitions are whole
but the gather/release machinery is the real one). The prompts are chat questions in the
model's own template; every prompt generates exactly ``max_tokens`` greedy tokens
(``ignore_eos``; ``min_new_tokens`` for transformers), so both sides produce the same count.

Rows:
  * ``hybrid``: one rollout = gather the partitions into zserve's runner + SplitFuse
    generation + release; tokens/s over the whole rollout (the number that counts) and over
    the generate phase alone, and each phase's time and memory;
  * ``hf_generate_zero3``: ``generate`` on the ZeRO-3 actor itself (every layer gathered and
    released per forward, the way generation runs without a hybrid engine);
  * ``hf_generate``: ``generate`` on a plain transformers model with the same weights
    (left-padded batch, transformers' KV cache), the strongest transformers baseline.
``speedup`` is the hybrid rollout's tokens/s over each. ``greedy_match`` is the fraction of
prompts whose hybrid tokens equal the plain ``generate``'s (a padded batch may flip a
near-tie late in a sequence; the unpadded equality is tests/zchat/test_hybrid.py's).

Run: ``z bench hybrid [MODEL_DIR] [--num-prompts 16] [--max-tokens 64] --json``.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from zcore.bench import load

_models = load("_models", Path(__file__).parent)

QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain what a binary search is.",
    "Write a short poem about the sea.",
    "How do plants make food?",
    "What causes the seasons on Earth?",
    "Name some uses of a paperclip.",
    "Why is the sky blue?",
    "How does a refrigerator keep food cold?",
    "What is the difference between weather and climate?",
    "Describe how to make a cup of tea.",
    "Why do we have leap years?",
)


def _ds_config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-6}},
        "zero_optimization": {"stage": 3},
    }


def _prompts(model_dir: Path, n: int) -> list[list[int]]:
    from zserve.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in qs]


def _hf_generate(model: Any, prompts: list[list[int]], max_tokens: int, pad: int) -> tuple:
    """Left-padded batched greedy ``generate``; (new tokens per prompt, seconds)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return [row[width:].tolist() for row in out], time.perf_counter() - t0


def run(
    model_dir: str | None = None,
    num_prompts: int = 16,
    max_tokens: int = 64,
    token_budget: int = 512,
    threads: int = 1,
    zero3_baseline: bool = True,
) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    import zcore
    import zcore.hf
    from zchat.hybrid import HybridEngine
    from zserve.sampling import SamplingParams

    mdir = Path(model_dir) if model_dir else _models.default_model_dir()
    if not (mdir / "config.json").is_file():
        raise FileNotFoundError(f"no model at `{mdir}`; run `make models` or pass MODEL_DIR")
    if num_prompts < 1 or max_tokens < 1:
        raise ValueError(f"--num-prompts {num_prompts} and --max-tokens {max_tokens} must be >= 1")
    torch.set_num_threads(threads)
    prompts = _prompts(mdir, num_prompts)
    actor = zcore.hf.from_pretrained(LlamaForCausalLM, mdir, ds_config=_ds_config())
    engine, *_ = zcore.initialize(actor, config=_ds_config())
    engine.eval()
    hybrid = HybridEngine(engine, token_budget=token_budget)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    hybrid.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    t0 = time.perf_counter()
    gens, stats = hybrid.generate(prompts, params)
    rollout_s = time.perf_counter() - t0
    tokens = stats.generated_tokens
    rows: dict[str, Any] = {
        "hybrid": {
            "tokens_per_s": tokens / rollout_s,
            "rollout_s": rollout_s,
            "generate_tokens_per_s": stats.tokens_per_s,
            "phases": stats.as_dict(),
        }
    }
    pad = int(hybrid.tokenizer.eos_token_ids[0]) if hybrid.tokenizer.eos_token_ids else 0
    if zero3_baseline:
        _hf_generate(engine.module, prompts[:1], 2, pad)  # warm-up
        z3_out, z3_s = _hf_generate(engine.module, prompts, max_tokens, pad)
        rows["hf_generate_zero3"] = {"tokens_per_s": sum(map(len, z3_out)) / z3_s, "seconds": z3_s}
    plain = LlamaForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
    _hf_generate(plain, prompts[:1], 2, pad)  # warm-up
    hf_out, hf_s = _hf_generate(plain, prompts, max_tokens, pad)
    rows["hf_generate"] = {"tokens_per_s": sum(map(len, hf_out)) / hf_s, "seconds": hf_s}
    match = sum(g.token_ids == h for g, h in zip(gens, hf_out, strict=True)) / len(gens)
    hyb = rows["hybrid"]["tokens_per_s"]
    speedup = {k: hyb / v["tokens_per_s"] for k, v in rows.items() if k != "hybrid"}
    return {
        "benchmark": "hybrid",
        "model": mdir.name,
        "num_prompts": num_prompts,
        "max_tokens": max_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": tokens,
        "token_budget": token_budget,
        "threads": threads,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "rows": rows,
        "speedup": speedup,
        "greedy_match": match,
        "target": {"speedup_over_hf_generate": 3.0, "met": speedup["hf_generate"] >= 3.0},
    }


def report(result: dict[str, Any]) -> str:
    r = result["rows"]
    p = r["hybrid"]["phases"]
    lines = [
        f"hybrid engine vs transformers generate, {result['model']}, {result['num_prompts']} "
        f"prompts x {result['max_tokens']} tokens, {result['threads']} thread(s)",
    ]
    for name, row in r.items():
        extra = f"  (hybrid {result['speedup'][name]:.2f}x)" if name in result["speedup"] else ""
        lines.append(f"  {name:18s} {row['tokens_per_s']:8.1f} tok/s{extra}")
    lines.append(
        f"  phases: gather {p['gather_s']:.2f} s ({p['weights_bytes'] / 2**20:.0f} MiB weights, "
        f"{p['kv_cache_bytes'] / 2**20:.0f} MiB KV), generate {p['generate_s']:.2f} s, "
        f"release {p['release_s']:.3f} s; actor {p['actor_bytes_before'] / 2**20:.0f} MiB "
        f"before, {p['actor_bytes_after'] / 2**20:.0f} MiB after"
    )
    lines.append(f"  greedy outputs equal to generate's: {result['greedy_match']:.0%}")
    return "\n".join(lines)
