"""zserve's ModelRunner against transformers on SmolLM2: prefill tokens/s and decode
steps/s (batch 1 and batch 16), the same work timed for both in the same run.

A helper module for ``benchmarks/serve.py`` (``zcore.bench.load("_serve_runner", Path(__file__).parent)``): each
``measure_*`` function and :func:`run` return a dict, :func:`report` renders one.
Prompts are real Shakespeare text, tokenized by the model's tokenizer and cut to equal
lengths (so transformers' batch needs no padding). transformers' decode rate is taken
from ``generate``: ``(new - 1) / (t(generate new tokens) - t(generate 1 token))``, i.e.
the steps after the prefill, which is what the runner's decode loop times.

Run alone: ``python benchmarks/_serve_runner.py [--threads N] [MODEL_DIR]``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zcore.bench import load
from zserve.runner import ModelRunner, SeqChunk

_models = load("_models", Path(__file__).parent)


def _interleaved_medians(fns: list[Callable[[], Any]], repeats: int) -> list[float]:
    """Median seconds of each of ``fns``, timed in rounds (one call of each per round) so
    they share whatever else the machine is doing; one untimed warm-up round first."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats + 1):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            if r:
                ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def _tables(runner: ModelRunner, count: int, tokens: int) -> list[list[int]]:
    per = -(-tokens // runner.block_size)
    if count * per > runner.num_blocks:
        raise ValueError(f"{count} x {per} blocks do not fit in {runner.num_blocks}")
    return [list(range(i * per, (i + 1) * per)) for i in range(count)]


def measure_prefill(runner: ModelRunner, hf: Any, prompt: list[int], repeats: int) -> dict:
    """One prompt's prefill: runner forward vs ``generate(max_new_tokens=1)``."""
    (table,) = _tables(runner, 1, len(prompt))
    ids = torch.tensor([prompt])
    ours, theirs = _interleaved_medians(
        [lambda: runner.forward([SeqChunk(0, prompt, 0, table)]), lambda: _generate(hf, ids, 1)],
        repeats,
    )
    n = len(prompt)
    return {
        "prompt_tokens": n,
        "zserve_tokens_per_s": n / ours,
        "hf_generate_tokens_per_s": n / theirs,
        "speedup": theirs / ours,
    }


def _generate(hf: Any, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        return hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )


def measure_decode(
    runner: ModelRunner, hf: Any, prompts: list[list[int]], steps: int, repeats: int
) -> dict:
    """``len(prompts)`` sequences decoding ``steps`` tokens together, one forward per step."""
    batch, length = len(prompts), len(prompts[0])
    tables = _tables(runner, batch, length + steps + 1)
    runner.forward([SeqChunk(i, p, 0, tables[i]) for i, p in enumerate(prompts)])

    def decode_loop() -> None:
        tokens = [p[-1] for p in prompts]
        for s in range(steps):
            chunks = [SeqChunk(i, [tokens[i]], length + s, tables[i]) for i in range(batch)]
            tokens = runner.forward(chunks).argmax(-1).tolist()

    ids = torch.tensor(prompts)
    ours, t_prefill, t_full = _interleaved_medians(
        [decode_loop, lambda: _generate(hf, ids, 1), lambda: _generate(hf, ids, steps + 1)],
        repeats,
    )
    hf_steps = steps / max(t_full - t_prefill, 1e-9)
    return {
        "batch": batch,
        "context_tokens": length,
        "steps": steps,
        "zserve_steps_per_s": steps / ours,
        "zserve_tokens_per_s": batch * steps / ours,
        "hf_generate_steps_per_s": hf_steps,
        "hf_generate_tokens_per_s": batch * hf_steps,
        "speedup": (steps / ours) / hf_steps,
    }


def run(
    model_dir: str | None = None,
    prefill_tokens: int = 512,
    decode_context: int = 128,
    steps: int = 16,
    repeats: int = 3,
    threads: int | None = None,
) -> dict:
    """Every measurement on one model load; ``threads`` None keeps torch's default."""
    from transformers import AutoModelForCausalLM

    if threads is not None:
        torch.set_num_threads(threads)
    path = Path(model_dir) if model_dir else _models.default_model_dir()
    runner = ModelRunner(path, num_blocks=512, block_size=16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _models.shakespeare_prompts(path, 17, max(prefill_tokens, decode_context))
    return {
        "model": path.name,
        "torch_threads": torch.get_num_threads(),
        "dtype": "fp32",
        "prefill": measure_prefill(runner, hf, prompts[0][:prefill_tokens], repeats),
        "decode_batch1": measure_decode(runner, hf, [prompts[1][:decode_context]], steps, repeats),
        "decode_batch16": measure_decode(
            runner, hf, [p[:decode_context] for p in prompts[1:17]], steps, repeats
        ),
    }


def report(result: dict) -> str:
    """A small table of the measurements."""
    lines = [
        f"{result['model']} fp32, {result['torch_threads']} torch thread(s)",
        f"{'work':<22}{'zserve':>14}{'hf generate':>14}{'speedup':>9}",
    ]
    p = result["prefill"]
    lines.append(
        f"{'prefill ' + str(p['prompt_tokens']) + ' tok (tok/s)':<22}"
        f"{p['zserve_tokens_per_s']:>14.1f}{p['hf_generate_tokens_per_s']:>14.1f}"
        f"{p['speedup']:>8.2f}x"
    )
    for key in ("decode_batch1", "decode_batch16"):
        d = result[key]
        lines.append(
            f"{'decode b=' + str(d['batch']) + ' (steps/s)':<22}"
            f"{d['zserve_steps_per_s']:>14.2f}{d['hf_generate_steps_per_s']:>14.2f}"
            f"{d['speedup']:>8.2f}x"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    threads = None
    if args[:1] == ["--threads"]:
        threads, args = int(args[1]), args[2:]
    res = run(args[0] if args else None, threads=threads)
    print(json.dumps(res, indent=2))
    print(report(res))
