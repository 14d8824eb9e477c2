"""zserve on compressed models: fp32 vs `z quantize` directories (W8A8, FP6, W4), same run.

Each recipe is quantized once with zquant's round-to-nearest (`z quantize MODEL --recipe R`:
every linear layer but the tied `lm_head`), written as a zquant directory and served by
zserve from it: W8A8 through the native INT8 GEMM with fused activation quantization, FP6
and W4 through the native dequantize-GEMM. Per model, in one process, one after another:

* `decode_tok_s`: batch-1 greedy decode, tokens/s after the first token (one request, a
  `prompt_tokens` Shakespeare prompt, `decode_tokens` outputs, EOS ignored);
* `concurrent_tok_s`: `concurrent` such requests added at once, generated tokens / wall
  time from the first add to the last token (SplitFuse, `token_budget` tokens per forward);
* `ppl`: perplexity of held-out Shakespeare (`ppl_tokens` tokens in 256-token windows) scored
  through the engine as `z eval --ppl` scores the directory (equal to it within the
  tolerances of `tests/zserve/test_quantized_serving.py`);
* `weights_bytes`: the size of `model.safetensors` (fp32 embeddings included).

Speed ratios are against fp32 of the same run. The CPU, torch threads and the load of the
machine are recorded: on a shared CPU, compare only rows of one run.

Run: ``z bench serve-quant [--recipes w8a8,w6a16,w4] [--quant-dir DIR] --json``.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from zcore.bench import load
from zserve.engine import Engine
from zserve.model.quantized_ppl import served_perplexity
from zserve.sampling import SamplingParams

_models = load("_models", Path(__file__).parent)

RECIPES = ("w8a8", "w6a16", "w4", "w4a8")
WINDOW = 256


def check_recipes(recipes: str) -> list[str]:
    """The comma-separated recipe names; ValueError naming an unknown one."""
    names = [r.strip() for r in recipes.split(",") if r.strip()]
    bad = [r for r in names if r not in RECIPES]
    if bad:
        raise ValueError(f"--recipes: unknown {bad}; zserve serves {', '.join(RECIPES)}")
    return names


def quantized_dir(
    model_dir: Path, recipe: str, root: Path, *, lm_head: str | None = None
) -> tuple[Path, float | None]:
    """`root/<model>-<recipe>` (`-head-<lm_head>` added when the LM head is quantized too,
    `z quantize --lm-head`), quantized now (seconds returned) unless already there."""
    from zquant.hf import load_model
    from zquant.ptq import quantize
    from zquant.schemes import get_recipe
    from zquant.serialize import save_quantized

    out = root / (f"{model_dir.name}-{recipe}" + (f"-head-{lm_head}" if lm_head else ""))
    if (out / "zquant.json").is_file():
        return out, None
    spec = get_recipe(recipe, lm_head=lm_head)
    model = load_model(model_dir)
    t0 = time.perf_counter()
    quantize(model, spec)
    seconds = time.perf_counter() - t0
    save_quantized(model, out, recipe=spec, source_dir=model_dir)
    return out, seconds


def _texts(tokenizer: Any, n: int) -> tuple[list[int], list[list[int]]]:
    """(held-out token ids for perplexity, `n` distinct training prompts' token ids)."""
    from ztrain.data import load_plays, split_plays

    train, val = split_plays(load_plays())
    held_out = tokenizer("\n".join(t for _, t in val)[:40_000], add_special_tokens=False)
    stream = tokenizer(train[0][1][:20_000], add_special_tokens=False)["input_ids"]
    return held_out["input_ids"], [stream[i * 97 :] for i in range(n)]


def _generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Add `prompts` at once, greedy, EOS ignored; wall time, first-token and last-token times."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, params)
    first: float | None = None
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
            if first is None and out.token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None and tokens == max_tokens * len(prompts)
    return {"wall": end - t0, "first": first - t0, "tokens": tokens}


def measure(
    model_dir: Path,
    held_out: list[int],
    prompts: list[list[int]],
    *,
    decode_tokens: int,
    concurrent: int,
    token_budget: int,
    ppl_tokens: int,
) -> dict[str, Any]:
    """One model's row: load time, decode and concurrent tokens/s, perplexity, size."""
    t0 = time.perf_counter()
    engine = Engine(model_dir, token_budget=token_budget, max_model_len=1024, max_num_seqs=32)
    load_s = time.perf_counter() - t0
    q = engine.runner.model.quantization
    _generate(engine, prompts[:1], 4)  # warm-up
    one = _generate(engine, prompts[:1], decode_tokens)
    many = _generate(engine, prompts[:concurrent], decode_tokens)
    ppl = served_perplexity(engine, held_out, max_tokens=ppl_tokens, window=WINDOW)
    kernels = sorted({v.split(" -> ")[1] for v in q.served.values()}) if q is not None else []
    return {
        "model_dir": str(model_dir),
        "load_s": round(load_s, 2),
        "decode_tok_s": round((decode_tokens - 1) / (one["wall"] - one["first"]), 2),
        "concurrent_tok_s": round(many["tokens"] / many["wall"], 2),
        "ppl": round(ppl, 4),
        "weights_bytes": (model_dir / "model.safetensors").stat().st_size
        if (model_dir / "model.safetensors").is_file()
        else sum(p.stat().st_size for p in model_dir.glob("*.safetensors")),
        "quantized_layers": 0 if q is None else len(q.served),
        "kernels": kernels,
    }


def run(
    model_dir: str | None = None,
    recipes: str = "w8a8,w6a16,w4",
    quant_dir: str | None = None,
    decode_tokens: int = 32,
    concurrent: int = 16,
    prompt_tokens: int = 64,
    token_budget: int = 256,
    ppl_tokens: int = 1024,
    threads: int = 2,
) -> dict[str, Any]:
    """fp32 and each recipe's zquant directory served by zserve; see the module docstring."""
    from zquant.hf import load_tokenizer

    names = check_recipes(recipes)
    src = Path(model_dir) if model_dir else _models.default_model_dir()
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in `{src}`; pass a HF model directory")
    torch.set_num_threads(threads)
    root = Path(quant_dir) if quant_dir else Path(tempfile.mkdtemp(prefix="zserve-quant-"))
    root.mkdir(parents=True, exist_ok=True)
    held_out, streams = _texts(load_tokenizer(src), concurrent)
    prompts = [s[:prompt_tokens] for s in streams]
    opts = {
        "decode_tokens": decode_tokens,
        "concurrent": concurrent,
        "token_budget": token_budget,
        "ppl_tokens": ppl_tokens,
    }
    rows: dict[str, Any] = {"fp32": measure(src, held_out, prompts, **opts)}
    for name in names:
        qdir, seconds = quantized_dir(src, name, root)
        rows[name] = measure(qdir, held_out, prompts, **opts)
        rows[name]["quantize_s"] = None if seconds is None else round(seconds, 1)
    base = rows["fp32"]
    for name in names:
        row = rows[name]
        row["decode_vs_fp32"] = round(row["decode_tok_s"] / base["decode_tok_s"], 3)
        row["concurrent_vs_fp32"] = round(row["concurrent_tok_s"] / base["concurrent_tok_s"], 3)
        row["ppl_vs_fp32"] = round(row["ppl"] / base["ppl"] - 1, 5)
        row["size_vs_fp32"] = round(row["weights_bytes"] / base["weights_bytes"], 3)
    return {
        "benchmark": "serve-quant",
        "model": src.name,
        "options": {**opts, "prompt_tokens": prompt_tokens, "threads": threads},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        },
        "rows": rows,
        "quant_dir": str(root),
    }


def report(result: dict[str, Any]) -> str:
    """A table of the rows."""
    lines = [
        f"{result['model']}, {result['options']['threads']} threads, "
        f"load avg {result['machine']['load_avg_1m']}",
        f"{'model':8} {'decode tok/s':>13} {'x16 tok/s':>10} {'ppl':>9} {'size MB':>8}  kernels",
    ]
    for name, row in result["rows"].items():
        lines.append(
            f"{name:8} {row['decode_tok_s']:13.1f} {row['concurrent_tok_s']:10.1f} "
            f"{row['ppl']:9.3f} {row['weights_bytes'] / 1e6:8.1f}  {','.join(row['kernels'])}"
        )
    return "\n".join(lines)
