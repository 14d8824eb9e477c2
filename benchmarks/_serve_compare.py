"""`z bench serve --compare llama.cpp`: zserve's engine against llama-cpp-python on the same
SmolLM2 weights, in the same run, at matched precision.

A helper module of ``benchmarks/serve.py`` (``zcore.bench.load("_serve_compare", Path(__file__).parent)``).
Pairs (ours vs theirs): fp32 vs F32, bf16 vs F16 (our runner in bfloat16: weights,
activations and KV cache), W8A8 (``z quantize --recipe w8a8``: INT8 GEMM with fused
activation quantization) vs Q8_0, and our 4-bit recipe (``w4`` by default) vs the GGUF's own
Q4_1. The peer's files come from :mod:`_llamacpp` (F16/Q8_0 made by llama.cpp's quantizer).
Both of its quantized files keep SmolLM2's tied LM head (``token_embd``) in Q8_0, so our
quantized pairs quantize the tied head to INT8 too (``z quantize --lm-head int8``); each
row's ``lm_head`` says what both sides ran, and the ``-fp32-head`` pairs keep ours in fp32.

Per pair and round, ours then theirs, each from an empty KV cache (our prefix caching off;
their context reset), greedy, EOS ignored, the same token ids:

* ``prefill_tok_s``: one ``prompt_tokens`` prompt / seconds to its first token;
* ``decode_tok_s``: that request's tokens after the first / seconds after the first;
* ``concurrent_tok_s``: ``concurrent`` distinct prompts, ``decode_tokens`` each: generated
  tokens / wall time. Ours: all added at once, SplitFuse batching (``token_budget`` tokens
  per forward). Theirs: one ``Llama`` context serving them one after another (see
  :mod:`_llamacpp` for why).

One warm-up round, then ``repeats`` rounds interleaved (ours, theirs, ours, ...) so both see
the same machine load; medians reported (each round's values under ``rounds``), and same-run
ratios ours/theirs. Targets (issue 20): concurrent ratio >= 1, batch-1 decode ratio >= 1/1.5;
at ``--simd avx2`` (issue 48): prefill and decode >= 1, concurrent >= 1.5. The JSON's
``simd`` records both sides' SIMD paths (:mod:`_serve_simd`).

Measured runs (date, host, command, ratios): ``benchmarks/results/serve-compare-llamacpp.md``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zserve.engine import Engine
from zserve.sampling import SamplingParams

#: ours -> (our dtype, zquant recipe or None, its LM head (`Recipe.lm_head`), llama.cpp file
#: type). llama.cpp's Q8_0 and Q4_1 GGUFs of SmolLM2 store the tied `token_embd` (its LM
#: head) as Q8_0, so the quantized pairs quantize our tied head too (`lm_head="int8"`: INT8
#: per row on the INT8 GEMM); the `-fp32-head` pairs keep it fp32 (the recipes' default) to
#: show what that costs, in the same run.
PAIRS: dict[str, tuple[str, str | None, str | None, str]] = {
    "fp32": ("float32", None, None, "F32"),
    "bf16": ("bfloat16", None, None, "F16"),
    "w8a8": ("float32", "w8a8", "int8", "Q8_0"),
    "w4": ("float32", "w4", "int8", "Q4_1"),
    "w4a8": ("float32", "w4a8", "int8", "Q4_1"),
    "w8a8-fp32-head": ("float32", "w8a8", None, "Q8_0"),
    "w4-fp32-head": ("float32", "w4", None, "Q4_1"),
}
#: What each llama.cpp file type stores the tied LM head (`token_embd`) as.
PEER_HEAD = {"F32": "F32", "F16": "F16", "Q8_0": "Q8_0", "Q4_1": "Q8_0"}
PEER_MODEL = "SmolLM2-135M-Instruct"
METRICS = ("prefill_tok_s", "decode_tok_s", "concurrent_tok_s")
#: `run_compare`'s options a `--simd` child gets as they are.
CHILD_ARGS = (
    "peer",
    "precisions",
    "prompt_tokens",
    "decode_tokens",
    "concurrent",
    "token_budget",
    "repeats",
    "threads",
    "gguf_dir",
    "quant_dir",
)


def check_precisions(precisions: str) -> list[str]:
    """The comma-separated pair names; ValueError naming an unknown one."""
    names = [p.strip() for p in precisions.split(",") if p.strip()]
    bad = [p for p in names if p not in PAIRS]
    if bad or not names:
        raise ValueError(f"--precisions {bad or precisions!r}: choose from {', '.join(PAIRS)}")
    return names


def _prompts(model_dir: Path, count: int, length: int) -> list[list[int]]:
    """``count`` distinct Shakespeare prompts of exactly ``length`` token ids."""
    from zserve.tokenizer import Tokenizer
    from ztrain.data import load_plays

    text = dict(load_plays())["Hamlet"][:200_000]
    ids = Tokenizer(model_dir).encode(text, add_special_tokens=False)
    if len(ids) < count * length:
        raise ValueError(f"Hamlet has {len(ids)} tokens; {count} x {length} asked for")
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def _ours_generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Add ``prompts`` at once; wall, first-token and last-token seconds, tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, params)
    first = None
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
            if first is None and out.token_ids:
                first = time.perf_counter() - t0
    last = time.perf_counter() - t0
    return {"first": first or last, "last": last, "wall": last, "tokens": tokens}


def _round(
    ours: Engine, theirs: Any, prompts: list[list[int]], decode_tokens: int, concurrent: int
) -> dict[str, dict[str, float]]:
    """One measurement of every metric, ours then theirs."""
    n = len(prompts[0])
    out: dict[str, dict[str, float]] = {}
    sides: list[tuple[str, Any]] = [("zserve", ours)] + ([("llama.cpp", theirs)] if theirs else [])
    for side, eng in sides:
        if side == "zserve":
            one = _ours_generate(eng, prompts[:1], decode_tokens)
            many = _ours_generate(eng, prompts[1 : 1 + concurrent], decode_tokens)
        else:
            one = eng.generate(prompts[0], decode_tokens)
            many = eng.serve(prompts[1 : 1 + concurrent], decode_tokens)
        out[side] = {
            "prefill_tok_s": n / one["first"],
            "decode_tok_s": (decode_tokens - 1) / max(one["last"] - one["first"], 1e-9),
            "concurrent_tok_s": many["tokens"] / many["wall"],
        }
    return out


def run_compare(
    model_dir: Path,
    *,
    peer: str = "llama.cpp",
    precisions: str = "fp32,bf16,w8a8,w4",
    prompt_tokens: int = 128,
    decode_tokens: int = 32,
    concurrent: int = 16,
    token_budget: int = 256,
    repeats: int = 3,
    threads: int = 2,
    gguf_dir: str | None = None,
    quant_dir: str | None = None,
    simd: str | None = None,
) -> dict[str, Any]:
    """Every pair in ``precisions``; see the module docstring. JSON-ready dict. ``simd``
    (``"avx2"``) runs it all in a child process forced to that level (:mod:`_serve_simd`)."""
    from zcore.bench import load

    if peer != "llama.cpp":
        raise ValueError(f"--compare {peer!r}: the only peer is 'llama.cpp'")
    names = check_precisions(precisions)
    if decode_tokens < 2 or repeats < 1 or concurrent < 1:
        raise ValueError("need --decode-tokens >= 2, --repeats >= 1 and --concurrent >= 1")
    simd_paths = load("_serve_simd", Path(__file__).parent)
    simd_paths.check(simd)
    if simd is not None and simd_paths.needs_child(simd):
        kw = {k: v for k, v in locals().items() if k in CHILD_ARGS}
        return simd_paths.run_forced(simd, model_dir, kw)
    lcpp = load("_llamacpp", Path(__file__).parent)
    serve_quant = load("serve_quant", Path(__file__).parent)
    torch.set_num_threads(threads)
    # znative's pool (our kernels) is sized once, at its first use, from this variable;
    # without it our side ran the native kernels on every core while the peer had `threads`.
    os.environ["ZNATIVE_NUM_THREADS"] = str(threads)
    peer_status: dict[str, Any] = lcpp.status()
    peer_simd = simd_paths.peer_info() if peer_status["available"] else None
    refusal = simd_paths.peer_refusal(simd, peer_simd or {})
    if refusal:
        peer_status = {"available": False, "skipped": refusal}
    elif simd is not None and not peer_status["available"]:
        peer_status["install"] = simd_paths.install_hint(simd)
    if peer_status["available"] and model_dir.name != PEER_MODEL:
        peer_status = {
            "available": False,
            "skipped": f"the peer's GGUF is {PEER_MODEL}'s; `{model_dir.name}` is another model",
        }
    cache = Path.home() / ".cache" / "zstack"
    ggufs: dict[str, Path] = {}
    if peer_status["available"]:
        want = sorted({PAIRS[n][3] for n in names})
        ggufs, made = lcpp.gguf_files(Path(gguf_dir) if gguf_dir else cache / "gguf", want, threads)
        peer_status["gguf_made_s"] = made
    # Quantized directories are kept (reused when present) beside the GGUF files.
    qroot = Path(quant_dir) if quant_dir else cache / "serve-compare-quant"
    prompts = _prompts(model_dir, 1 + concurrent, prompt_tokens)
    n_ctx = prompt_tokens + decode_tokens + 8
    rows: dict[str, Any] = {}
    for name in names:
        dtype, recipe, head, ftype = PAIRS[name]
        mdir = (
            model_dir
            if recipe is None
            else serve_quant.quantized_dir(model_dir, recipe, qroot, lm_head=head)[0]
        )
        ours = Engine(
            mdir,
            dtype=dtype,
            token_budget=token_budget,
            max_num_seqs=max(concurrent, 1),
            max_model_len=max(n_ctx, 64),
            prefix_caching=False,
        )
        theirs = None
        if peer_status["available"]:
            theirs = lcpp.LlamaCppPeer(
                ggufs[ftype], threads=threads, n_ctx=n_ctx, n_batch=max(prompt_tokens, 32)
            )
        samples: dict[str, dict[str, list[float]]] = {}
        for r in range(repeats + 1):
            got = _round(ours, theirs, prompts, decode_tokens, concurrent)
            if r == 0:
                continue  # warm-up: first-call allocations, page faults
            for side, m in got.items():
                for k, v in m.items():
                    samples.setdefault(side, {}).setdefault(k, []).append(v)
        row: dict[str, Any] = {
            "ours": f"zserve {dtype}" + (f" {recipe}" if recipe else ""),
            "theirs": f"llama.cpp {ftype}",
            "lm_head": {"ours": head or dtype, "theirs": PEER_HEAD[ftype]},
        }
        for side, ms in samples.items():
            row[side] = {k: round(statistics.median(v), 2) for k, v in ms.items()}
        row["rounds"] = {  # every timed round, in order, for the note
            side: {k: [round(x, 2) for x in v] for k, v in ms.items()}
            for side, ms in samples.items()
        }
        if "llama.cpp" in row:
            row["ratio"] = {k: round(row["zserve"][k] / row["llama.cpp"][k], 3) for k in METRICS}
            row["targets"] = targets(row["ratio"], simd)
        rows[name] = row
        print(f"serve-compare {name}: {json.dumps(row)}", file=sys.stderr, flush=True)  # progress
        del ours, theirs
    return {
        "benchmark": "serve-compare",
        "model": model_dir.name,
        "peer": {"name": peer, **peer_status, "driven_as": "one Llama context, requests in turn"},
        "options": {
            "precisions": names,
            "prompt_tokens": prompt_tokens,
            "decode_tokens": decode_tokens,
            "concurrent": concurrent,
            "token_budget": token_budget,
            "repeats": repeats,
            "threads": threads,
            "znative_threads": _znative_threads(),
            "simd": simd,
        },
        "simd": simd_paths.record(simd, peer_simd),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        },
        "rows": rows,
    }


def targets(ratio: dict[str, float], simd: str | None) -> dict[str, bool]:
    """Issue 20's targets; at ``--simd avx2`` issue 48's (decode and prefill >= 1, x16 >= 1.5)."""
    if simd == "avx2":
        return {
            "prefill_ge_1": ratio["prefill_tok_s"] >= 1.0,
            "decode_ge_1": ratio["decode_tok_s"] >= 1.0,
            "concurrent_ge_1_5": ratio["concurrent_tok_s"] >= 1.5,
        }
    return {
        "concurrent_ge_1": ratio["concurrent_tok_s"] >= 1.0,
        "decode_within_1_5x": ratio["decode_tok_s"] >= 1 / 1.5,
    }


def _znative_threads() -> int | None:
    """Threads of znative's kernel pool (the pool exists once a kernel has run)."""
    try:
        import znative
    except ImportError:
        return None
    return int(znative.num_threads())


def report(result: dict[str, Any]) -> str:
    """One line per pair and side, then the ratios."""
    peer = result["peer"]
    lines = [
        f"{result['model']}: zserve vs {peer['name']} ({result['options']['threads']} threads, "
        f"load avg {result['machine']['load_avg_1m']}); medians of "
        f"{result['options']['repeats']} interleaved rounds",
    ]
    if "simd" in result:
        s = result["simd"]
        lines.append(
            f"  SIMD ({s['requested']}): znative {s.get('znative')}, torch {s['torch']}, "
            f"llama.cpp {s.get('llama.cpp') or 'not run'}"
        )
    if not peer["available"]:
        lines.append(f"  peer not run: {peer.get('install') or peer.get('skipped')}")
    lines.append(
        f"{'pair':6} {'side':22} {'prefill tok/s':>14} {'decode tok/s':>13} {'x16 tok/s':>10}"
    )
    for name, row in result["rows"].items():
        for side, label in (("zserve", row["ours"]), ("llama.cpp", row["theirs"])):
            if side in row:
                m = row[side]
                lines.append(
                    f"{name:6} {label:22} {m['prefill_tok_s']:14.1f} {m['decode_tok_s']:13.1f} "
                    f"{m['concurrent_tok_s']:10.1f}"
                )
        if "ratio" in row:
            q = row["ratio"]
            lines.append(
                f"{name:6} {'ours / theirs':22} {q['prefill_tok_s']:13.2f}x "
                f"{q['decode_tok_s']:12.2f}x {q['concurrent_tok_s']:9.2f}x"
            )
    return "\n".join(lines)
