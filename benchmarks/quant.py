"""ZeroQuant recipes on real models: size vs fp16, accuracy, and quantized-linear latency.

For each recipe (w8a8, w4a8, w6a16, w8, w4; plus w4 with LKD, and the `gptq` recipes
again with GPTQ rounding and `gptq_refits` least-squares scale refits, `<recipe>+gptq`,
where `<recipe>:gN` makes its weights group-wise in groups of N, e.g. `w6a16:g32`):

- all-MiniLM-L6-v2 (clean fp32 encoder): mean cosine similarity of mean-pooled sentence
  embeddings against the fp32 model over `sentences` held-out Shakespeare sentences (plays
  `ztrain.data.VAL_TITLES`); LKD and GPTQ calibrate on sentences of the other plays
  (`lkd_sentences`, `gptq_sentences`; `gptq_lm_sentences` for SmolLM2), never on the
  evaluation text.
- SmolLM2-135M (fp32 dequantized from its 4-bit GGUF; that fp32 model is the baseline):
  perplexity of the first `ppl_tokens` tokens of a held-out play, in windows of 256.
- size: packed codes + scales (+ fp32 biases) of the quantized linears against the same
  layers in fp16 (`linear_ratio_vs_fp16`), and of the whole model with every other tensor
  counted in fp16 (`model_ratio_vs_fp16`).

Then the latency of each quantized linear against fp32 `F.linear` at several batch sizes
(`_quant_latency.py`, interleaved medians in the same run) and, when `zquant.xtc` is
present, XTC's binary MiniLM before and after distillation.

Run: `z bench quant --json` (about 10 minutes on 2 cores; `--no-smollm2`, `--no-latency`,
`--xtc-steps 0` shorten it).
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zcore.bench import load

_latency = load("_quant_latency", Path(__file__).parent)
_T0 = time.perf_counter()


def _log(message: str) -> None:
    """Progress on stderr (stdout ends with the one JSON object)."""
    print(f"[{time.perf_counter() - _T0:7.1f} s] {message}", file=sys.stderr, flush=True)


RECIPES = ("w8a8", "w4a8", "w6a16", "w8", "w4")


def _split_group(label: str) -> tuple[str, int | None]:
    """`w6a16:g32` -> ("w6a16", 32); a plain recipe name -> (name, None)."""
    name, _, group = label.partition(":")
    if not group:
        return name, None
    if not (group.startswith("g") and group[1:].isdigit() and int(group[1:]) > 0):
        raise ValueError(f"recipe {label!r}: write a group size as `{name}:g32` (N > 0)")
    return name, int(group[1:])


def _recipe(label: str, group_size: int | None) -> Any:
    """The recipe a bench label names: `:gN` wins, else `group_size` for the INT4 recipes."""
    from zquant.schemes import get_recipe

    name, group = _split_group(label)
    return get_recipe(name, group_size=group or (group_size if "w4" in name else None))


def _sentences(split: str, limit: int) -> list[str]:
    from zquant.metrics import sentences_from_text
    from ztrain.data import load_plays, split_plays

    train, val = split_plays(load_plays())
    plays = train if split == "train" else val
    return sentences_from_text("\n".join(t for _, t in plays), limit=limit)


def _size(model: torch.nn.Module) -> dict[str, Any]:
    from zquant.ptq import model_size

    s = model_size(model)
    return {
        "linear_bytes": s["linear_bytes"],
        "linear_fp16_bytes": s["linear_fp16_bytes"],
        "linear_ratio_vs_fp16": round(s["linear_fp16_bytes"] / s["linear_bytes"], 3),
        "model_bytes": s["total_bytes"],
        "model_fp16_bytes": s["fp16_bytes"],
        "model_ratio_vs_fp16": round(s["fp16_bytes"] / s["total_bytes"], 3),
    }


def models_root() -> Path:
    """Where `make setup` put the real models: `$ZSTACK_MODELS` or `~/.cache/zstack/models`."""
    return Path(os.environ.get("ZSTACK_MODELS", Path.home() / ".cache" / "zstack" / "models"))


def _model_dir(name: str) -> Path:
    path = models_root() / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model `{name}` not found at `{path}`; run `make setup`")
    return path


def _minilm(
    recipes: list[str],
    n: int,
    lkd_steps: int,
    lkd_sentences: int,
    group_size: int | None,
    gptq: list[str],
    gptq_sentences: int,
    gptq_refits: int,
) -> dict[str, Any]:
    from zquant.hf import load_model, load_tokenizer
    from zquant.lkd import calibration_batches
    from zquant.metrics import embedding_similarity, sentence_embeddings
    from zquant.ptq import quantize

    path = _model_dir("all-MiniLM-L6-v2")
    base, tokenizer = load_model(path), load_tokenizer(path)
    evals = _sentences("val", n)
    reference = sentence_embeddings(base, tokenizer, evals)
    rows: dict[str, Any] = {}

    def measure(label: str, recipe_name: str, **options: Any) -> None:
        t0 = time.perf_counter()
        model = quantize(copy.deepcopy(base), _recipe(recipe_name, group_size), **options)
        seconds = time.perf_counter() - t0
        cosine = embedding_similarity(model, tokenizer, evals, reference)
        rows[label] = {"cosine": round(cosine, 5), "quantize_s": round(seconds, 2), **_size(model)}
        _log(f"minilm {label}: cosine {cosine:.5f}")

    for name in recipes:
        measure(name, name)
    if lkd_steps and "w4" in recipes:
        calib = calibration_batches(tokenizer, _sentences("train", lkd_sentences))
        measure("w4+lkd", "w4", calib=calib, steps=lkd_steps, lr=1e-4)
    if gptq:
        calib = calibration_batches(tokenizer, _sentences("train", gptq_sentences))
        for name in gptq:
            measure(f"{name}+gptq", name, calib=calib, rounding="gptq", scale_refits=gptq_refits)
    out: dict[str, Any] = {"eval_sentences": len(evals), "recipes": rows}
    if gptq:
        out["gptq"] = {"calib_sentences": gptq_sentences, "scale_refits": gptq_refits}
    if "w4+lkd" in rows:
        out["lkd"] = {
            "steps_per_block": lkd_steps,
            "calib_sentences": lkd_sentences,
            "cosine_gain": round(rows["w4+lkd"]["cosine"] - rows["w4"]["cosine"], 5),
        }
    return out


def _smollm2(
    recipes: list[str],
    tokens: int,
    group_size: int | None,
    gptq: list[str],
    gptq_sentences: int,
    gptq_refits: int,
) -> dict[str, Any]:
    from zquant.hf import load_model, load_tokenizer
    from zquant.lkd import calibration_batches
    from zquant.metrics import perplexity
    from zquant.ptq import quantize
    from ztrain.data import load_plays, split_plays

    path = _model_dir("SmolLM2-135M-Instruct")
    tokenizer = load_tokenizer(path)
    title, text = split_plays(load_plays())[1][0]
    base = perplexity(load_model(path), tokenizer, text, max_tokens=tokens)
    rows: dict[str, Any] = {}
    calib = (
        calibration_batches(tokenizer, _sentences("train", gptq_sentences), max_length=128)
        if gptq
        else None
    )
    runs = [(name, name, {}) for name in recipes]
    options = {"calib": calib, "rounding": "gptq", "scale_refits": gptq_refits}
    runs += [(f"{name}+gptq", name, options) for name in gptq]
    for label, name, opts in runs:
        t0 = time.perf_counter()
        model = quantize(load_model(path), _recipe(name, group_size), **opts)
        seconds = time.perf_counter() - t0
        ppl = perplexity(model, tokenizer, text, max_tokens=tokens)
        rows[label] = {
            "ppl": round(ppl, 4),
            "ppl_ratio": round(ppl / base, 5),
            "within_2pct": abs(ppl / base - 1) <= 0.02,
            "quantize_s": round(seconds, 2),
            **_size(model),
        }
        del model
        _log(f"smollm2 {label}: ppl {ppl:.4f} (fp32 {base:.4f})")
    out = {"text": title, "tokens": tokens, "window": 256, "fp32_ppl": round(base, 4)}
    if gptq:
        out["gptq"] = {
            "calib_sentences": gptq_sentences,
            "max_length": 128,
            "scale_refits": gptq_refits,
        }
    return {**out, "recipes": rows}


def _xtc(steps: int, sentences: int, n: int) -> dict[str, Any] | str:
    try:
        from zquant.xtc import xtc_report
    except ImportError as exc:
        return f"zquant.xtc not importable ({exc})"
    result = xtc_report(
        str(_model_dir("all-MiniLM-L6-v2")),
        steps,
        sentences=_sentences("train", sentences),
        eval_sentences=_sentences("val", n),
    )
    result.pop("model", None)
    return result


def check_recipes(recipes: str, gptq: str) -> tuple[list[str], list[str]]:
    """The comma-separated `recipes` and `gptq` lists, or a ValueError naming the bad entry."""
    names = [r.strip() for r in recipes.split(",") if r.strip()]
    gptq_names = [r.strip() for r in gptq.split(",") if r.strip()]
    unknown = sorted({_split_group(n)[0] for n in names + gptq_names} - set(RECIPES))
    if unknown:
        raise ValueError(f"unknown recipe(s) {unknown}; use some of {', '.join(RECIPES)}")
    return names, gptq_names


def run(
    recipes: str = ",".join(RECIPES),
    sentences: int = 200,
    ppl_tokens: int = 4096,
    group_size: int | None = None,
    lkd_steps: int = 3,
    lkd_sentences: int = 32,
    gptq: str = "w8a8,w6a16,w6a16:g32",
    gptq_sentences: int = 1024,
    gptq_lm_sentences: int = 256,
    gptq_refits: int = 3,
    smollm2: bool = True,
    latency: bool = True,
    batches: str = "1,16,64,256",
    repeats: int = 20,
    xtc_steps: int = 60,
    threads: int = 2,
) -> dict[str, Any]:
    """Measure every recipe in `recipes` (comma-separated); see the module docstring."""
    names, gptq_names = check_recipes(recipes, gptq)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "quant",
        "torch_threads": torch.get_num_threads(),
        "group_size": group_size or 32,
        "minilm": _minilm(
            names,
            sentences,
            lkd_steps,
            lkd_sentences,
            group_size,
            gptq_names,
            gptq_sentences,
            gptq_refits,
        ),
    }
    if smollm2:
        result["smollm2"] = _smollm2(
            names, ppl_tokens, group_size, gptq_names, gptq_lm_sentences, gptq_refits
        )
    if latency:
        _log("latency of quantized linears")
        from zcore.bench import numbers

        sizes = tuple(numbers("--batches", batches))
        result["latency"] = _latency.run_all(batch_sizes=sizes, repeats=repeats, threads=threads)
    if xtc_steps:
        _log(f"xtc, {xtc_steps} distillation steps")
        result["xtc"] = _xtc(xtc_steps, 64, sentences)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def report(result: dict[str, Any]) -> str:
    """Tables: per recipe size ratio and accuracy, then latency, then XTC."""
    lines = [f"MiniLM (cosine vs fp32 over {result['minilm']['eval_sentences']} sentences)"]
    lines.append(f"{'recipe':>11} {'cosine':>8} {'linear x':>9} {'model x':>8}")
    for name, r in result["minilm"]["recipes"].items():
        lines.append(
            f"{name:>11} {r['cosine']:>8.5f} {r['linear_ratio_vs_fp16']:>8.2f}x "
            f"{r['model_ratio_vs_fp16']:>7.2f}x"
        )
    if "smollm2" in result:
        s = result["smollm2"]
        lines.append(
            f"\nSmolLM2 perplexity, {s['tokens']} tokens of {s['text']} (fp32 {s['fp32_ppl']:.3f})"
        )
        lines.append(f"{'recipe':>11} {'ppl':>9} {'ratio':>7} {'linear x':>9} {'model x':>8}")
        for name, r in s["recipes"].items():
            lines.append(
                f"{name:>11} {r['ppl']:>9.3f} {r['ppl_ratio']:>7.4f} "
                f"{r['linear_ratio_vs_fp16']:>8.2f}x {r['model_ratio_vs_fp16']:>7.2f}x"
            )
    if "latency" in result:
        lines.append("\nLatency vs fp32 F.linear")
        lines.append(_latency.report(result["latency"]))
    if isinstance(result.get("xtc"), dict):
        x = result["xtc"]
        lines.append(
            f"\nXTC binary MiniLM ({x['steps']} steps): untrained {x['cosine_untrained_full_layers']:.4f}, "
            f"distilled {x['cosine_distilled']:.4f}, {x['model_ratio']:.1f}x smaller than fp32"
        )
    lines.append(f"\n{result['seconds']} s")
    return "\n".join(lines)
