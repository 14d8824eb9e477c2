"""`z` commands of zquant. Imports only typer at load time; zquant loads when a command runs.

- `z quantize MODEL_DIR --recipe w8a8 --out DIR [--lkd | --gptq [--gptq-refits K]] [--group-size N] [--skip PATTERN] [--lm-head int8]`
- `z eval MODEL_DIR --ppl TEXT_FILE` / `z eval MODEL_DIR --embeddings [--reference DIR]`
- `z bench quant` (`benchmarks/quant.py`)
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

import typer


class RecipeName(str, Enum):
    """Named zquant recipes (`zquant.schemes.get_recipe`)."""

    w8a8 = "w8a8"
    w4a8 = "w4a8"
    w6a16 = "w6a16"
    w8 = "w8"
    w4 = "w4"
    xtc = "xtc"


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _shakespeare(split: str, limit: int) -> list[str]:
    from zquant.metrics import sentences_from_text
    from ztrain.data import load_plays, split_plays

    train, val = split_plays(load_plays())
    plays = train if split == "train" else val
    return sentences_from_text("\n".join(t for _, t in plays), limit=limit)


def _load_any(model_dir: Path) -> Any:
    """A zquant directory (`zquant.json`) through `load_quantized`, else a plain HF model."""
    from zquant.hf import load_model
    from zquant.serialize import MANIFEST, load_quantized

    if (model_dir / MANIFEST).is_file():
        return load_quantized(model_dir)
    return load_model(model_dir)


def quantize_cmd(
    model_dir: Path = typer.Argument(
        ..., help="Hugging Face model directory (config.json + safetensors)."
    ),
    recipe: RecipeName = typer.Option(..., "--recipe", help="Quantization recipe."),
    out: Path = typer.Option(..., "--out", help="Directory to write the quantized model to."),
    lkd: bool = typer.Option(
        False, "--lkd", help="Layer-by-layer distillation on Shakespeare sentences."
    ),
    group_size: int | None = typer.Option(
        None, "--group-size", help="INT4 group size (default 32)."
    ),
    skip: list[str] = typer.Option(
        [], "--skip", help="Keep layers matching this glob in full precision."
    ),
    lm_head: str | None = typer.Option(
        None,
        "--lm-head",
        help="Quantize the (tied) LM head too: `int8` (W8A8's INT8 GEMM); default full precision.",
    ),
    lkd_steps: int = typer.Option(
        20, "--lkd-steps", min=0, help="Passes over the calibration set per block."
    ),
    lkd_sentences: int = typer.Option(
        64, "--lkd-sentences", min=1, help="LKD calibration sentences."
    ),
    gptq: bool = typer.Option(
        False, "--gptq", help="GPTQ rounding calibrated on Shakespeare sentences (int/fp6)."
    ),
    gptq_sentences: int = typer.Option(
        256, "--gptq-sentences", min=1, help="GPTQ calibration sentences."
    ),
    gptq_refits: int = typer.Option(
        3, "--gptq-refits", min=0, help="Least-squares scale refits after GPTQ rounding."
    ),
) -> None:
    """Quantize MODEL_DIR with a recipe and save it (safetensors + `zquant.json`) to OUT."""
    import time

    import torch

    from zquant.hf import load_model, load_tokenizer, read_config
    from zquant.ptq import model_size, quantize
    from zquant.schemes import get_recipe
    from zquant.serialize import save_quantized

    try:
        read_config(model_dir)
        spec = get_recipe(recipe.value, group_size=group_size, skip=tuple(skip), lm_head=lm_head)
        model = load_model(model_dir)
        spec.plan(model)  # reject bad patterns/shapes before any work
    except (ValueError, OSError) as exc:
        raise _fail(str(exc)) from None
    if lkd and gptq:
        raise _fail("--lkd and --gptq are two ways to round the same weights; pick one")
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    t0 = time.perf_counter()
    options: dict[str, Any] = {}
    if lkd or gptq:
        from zquant.lkd import calibration_batches

        n = lkd_sentences if lkd else gptq_sentences
        calib = calibration_batches(load_tokenizer(model_dir), _shakespeare("train", n))
        options = (
            {"calib": calib, "steps": lkd_steps}
            if lkd
            else {"calib": calib, "rounding": "gptq", "scale_refits": gptq_refits}
        )
    try:
        quantize(model, spec, **options)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    seconds = time.perf_counter() - t0
    path = save_quantized(
        model,
        out,
        recipe=spec,
        source_dir=model_dir,
        extra={"lkd": lkd, "gptq": gptq, **({"gptq_refits": gptq_refits} if gptq else {})},
    )
    size = model_size(model)
    how = (" + lkd" if lkd else " + gptq" if gptq else "") + (
        f", {lm_head} head" if lm_head else ""
    )
    typer.echo(
        f"quantized `{model_dir}` with {recipe.value}{how} in {seconds:.1f} s: "
        f"linear layers {size['linear_fp16_bytes'] / size['linear_bytes']:.2f}x smaller than fp16; "
        f"wrote `{path}`"
    )


def eval_cmd(
    model_dir: Path = typer.Argument(
        ..., help="A quantized (`z quantize`) or plain HF model directory."
    ),
    ppl: Path | None = typer.Option(None, "--ppl", help="Text file: report perplexity on it."),
    embeddings: bool = typer.Option(
        False, "--embeddings", help="Embedding cosine vs a reference model."
    ),
    reference: Path | None = typer.Option(
        None, "--reference", help="Reference model for --embeddings (default: MODEL_DIR itself)."
    ),
    max_tokens: int = typer.Option(2048, "--max-tokens", min=2, help="Token budget of --ppl."),
    window: int = typer.Option(256, "--window", min=2, help="Tokens per --ppl window."),
    sentences: int = typer.Option(
        200, "--sentences", min=1, help="Held-out sentences of --embeddings."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Perplexity of MODEL_DIR on a text file, or its sentence-embedding cosine to a reference."""
    if (ppl is None) == (not embeddings):
        raise _fail("pass exactly one of `--ppl TEXT_FILE` or `--embeddings`")
    import torch

    from zquant.hf import load_tokenizer
    from zquant.metrics import embedding_similarity, perplexity, sentence_embeddings

    torch.set_num_threads(min(torch.get_num_threads(), 4))
    result: dict[str, Any] = {"model": str(model_dir)}
    try:
        model = _load_any(model_dir)
        tokenizer = load_tokenizer(model_dir)
        if ppl is not None:
            if not ppl.is_file():
                raise FileNotFoundError(f"text file `{ppl}` not found; pass a UTF-8 text file")
            text = ppl.read_text(encoding="utf-8")
            result.update(
                ppl=perplexity(model, tokenizer, text, max_tokens=max_tokens, window=window),
                text=str(ppl),
                max_tokens=max_tokens,
                window=window,
            )
        else:
            ref_dir = reference or model_dir
            texts = _shakespeare("val", sentences)
            ref = sentence_embeddings(_load_any(ref_dir), load_tokenizer(ref_dir), texts)
            result.update(
                cosine=embedding_similarity(model, tokenizer, texts, ref),
                reference=str(ref_dir),
                sentences=len(texts),
            )
    except (ValueError, OSError) as exc:
        raise _fail(str(exc)) from None
    if json_out:
        typer.echo(json.dumps(result))
    elif "ppl" in result:
        typer.echo(f"perplexity {result['ppl']:.4f} over {max_tokens} tokens of `{ppl}`")
    else:
        typer.echo(
            f"mean cosine {result['cosine']:.5f} vs `{result['reference']}` over {result['sentences']} sentences"
        )


def bench_quant(
    recipes: str = typer.Option(
        "w8a8,w4a8,w6a16,w8,w4", "--recipes", help="Comma-separated recipes."
    ),
    sentences: int = typer.Option(200, "--sentences", min=1, help="MiniLM held-out sentences."),
    ppl_tokens: int = typer.Option(
        4096, "--ppl-tokens", min=256, help="SmolLM2 perplexity tokens."
    ),
    group_size: int | None = typer.Option(
        None, "--group-size", min=1, help="INT4 group (default 32)."
    ),
    lkd_steps: int = typer.Option(
        3, "--lkd-steps", min=0, help="LKD passes per block (0: no LKD row)."
    ),
    gptq: str = typer.Option(
        "w8a8,w6a16,w6a16:g32",
        "--gptq",
        help="Recipes to run again with GPTQ rounding, `name` or `name:gN` for groups of N "
        "('' for none).",
    ),
    gptq_sentences: int = typer.Option(
        1024, "--gptq-sentences", min=1, help="MiniLM GPTQ calibration sentences."
    ),
    gptq_lm_sentences: int = typer.Option(
        256, "--gptq-lm-sentences", min=1, help="SmolLM2 GPTQ calibration sentences."
    ),
    gptq_refits: int = typer.Option(
        3, "--gptq-refits", min=0, help="Least-squares scale refits after GPTQ rounding."
    ),
    no_smollm2: bool = typer.Option(False, "--no-smollm2", help="Skip the SmolLM2 perplexities."),
    no_latency: bool = typer.Option(False, "--no-latency", help="Skip the per-linear latencies."),
    batches: str = typer.Option("1,16,64,256", "--batches", help="Latency batch sizes."),
    repeats: int = typer.Option(
        20, "--repeats", min=1, help="Timed calls per latency cell (median)."
    ),
    xtc_steps: int = typer.Option(
        60, "--xtc-steps", min=0, help="XTC distillation steps (0: skip)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """Size vs fp16 and accuracy per recipe on MiniLM/SmolLM2, and quantized-linear latency."""
    from zstack.bench import load, run_benchmark

    try:
        load("quant").check_recipes(recipes, gptq)
    except ValueError as exc:
        raise _fail(str(exc)) from None

    raise typer.Exit(
        run_benchmark(
            "quant",
            json_out,
            recipes=recipes,
            sentences=sentences,
            ppl_tokens=ppl_tokens,
            group_size=group_size,
            lkd_steps=lkd_steps,
            gptq=gptq,
            gptq_sentences=gptq_sentences,
            gptq_lm_sentences=gptq_lm_sentences,
            gptq_refits=gptq_refits,
            smollm2=not no_smollm2,
            latency=not no_latency,
            batches=batches,
            repeats=repeats,
            xtc_steps=xtc_steps,
        )
    )


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add this module's commands to `z` and `z bench`."""
    app.command("quantize")(quantize_cmd)
    app.command("eval")(eval_cmd)
    bench_app.command("quant")(bench_quant)
