"""zserve serves `z quantize` directories: W8A8 through the native INT8 GEMM with fused
activation quantization, FP6 and INT4 (W4A8's MLP) through the native dequantize-GEMM, the
recipe's full-precision layers (and a bf16-stored one) as plain weights, a pruned
(`redundancy_clean`) MLP at its stored width; a directory it cannot serve is a clear error.

The perplexity of the served model equals `z eval`'s of the same directory on the same
Shakespeare windows. Measured (SmolLM2-135M, 1024 tokens, all layers quantized): FP6 7e-9
relative, W8A8 2e-7, when a forward holds the same tokens as `z eval`'s batch. The W8A8 recipe
keeps each call's 8 largest activation channels out of INT8 (`OutlierQuantLinear`), chosen
over the tokens *of that call*, so W8A8's numbers depend on what a forward holds: with one
window per forward instead of `z eval`'s batch of windows, W8A8 moved by 3.6e-4 relative on
the whole model, 2.6e-3 on this test's 4-layer directory (1.7e-3 with 128-token chunks). So
the tolerance is RTOL 1e-5 with the forward matched to `z eval`'s batch (token_budget =
windows x window; FP6 is batch-independent and meets it at any budget), and RTOL_BATCHING
5e-3 for W8A8 batched differently.

W4A8's INT4 MLP runs in float: `z eval` (zquant's `auto` backend) dequantizes the weight and
calls MKL, zserve the fused native dequantize-GEMM; their last-bit differences flip a few
INT8 activation codes of the next layer. Measured 3.6e-4 / 4.1e-4 relative between the two
(RTOL_KERNELS 1e-3), 1.1e-7 when zquant's loader runs the same native kernels (RTOL).

A quantized LM head (`z quantize --lm-head int8`: W8A8 per row, 8 outlier channels) runs on
the same INT8 kernel as W8A8's projections and has W8A8's tolerances: RTOL with the forward
matched to `z eval`'s batch, RTOL_BATCHING otherwise (its outlier channels are chosen over
the rows of each call). Its test quantizes the head alone (every layer skipped), so the
difference measured is the head's.

Only layers 0-3 are quantized (`--skip` the rest: FP6 rounding of the whole 135M model takes
minutes on a shared 2-core CPU); the 4 quantized layers run every kernel, and the skipped ones
are the per-module full-precision fallback list.

`z quantize` and `z eval` are made here through the zquant calls those commands make
(`_quantize`, `z_eval_ppl`), in this process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.utils.models import smollm2_dir
from zserve.engine import Engine, make_engine
from zserve.model.quantized import QuantizedModelError
from zserve.model.quantized_ppl import served_perplexity
from zserve.sampling import SamplingParams

# About 120 s in all on a quiet 2-core machine: the xdist workers start this file first.
pytestmark = pytest.mark.heavy(120)

RTOL = 1e-5
RTOL_BATCHING = 5e-3
RTOL_KERNELS = 1e-3
WINDOW, PPL_TOKENS = 256, 512  # z eval --window / --max-tokens: two windows, one batch
SKIP = ("model.layers.[4-9].*", "model.layers.[12][0-9].*")  # quantize layers 0-3 only
QUANTIZED_LAYERS = 4 * 7


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    from ztrain.data import load_plays, split_plays

    _, val = split_plays(load_plays())
    path = tmp_path_factory.mktemp("text") / "val.txt"
    path.write_text("\n".join(t for _, t in val)[:8000], encoding="utf-8")
    return path


def _quantize(tmp_path_factory, recipe: str, **options) -> Path:
    """What `z quantize SMOLLM2 --recipe RECIPE [--skip ...] [--lm-head ...] --out DIR` writes,
    through the zquant calls it makes."""
    from zquant.hf import load_model
    from zquant.ptq import quantize
    from zquant.schemes import get_recipe
    from zquant.serialize import save_quantized

    out = tmp_path_factory.mktemp("q") / f"smollm2-{recipe}"
    spec = get_recipe(recipe, **{"skip": SKIP, **options})
    model = load_model(smollm2_dir())
    quantize(model, spec)
    return save_quantized(model, out, recipe=spec, source_dir=smollm2_dir())


@pytest.fixture(scope="module")
def w8a8_dir(tmp_path_factory) -> Path:
    return _quantize(tmp_path_factory, "w8a8")


@pytest.fixture(scope="module")
def fp6_dir(tmp_path_factory) -> Path:
    return _quantize(tmp_path_factory, "w6a16")


def z_eval_ppl(model_dir: Path, text: Path) -> float:
    """What `z eval MODEL_DIR --ppl TEXT --max-tokens PPL_TOKENS --window WINDOW` reports:
    zquant's perplexity of the directory as `load_quantized` reads it."""
    from zquant.hf import load_tokenizer
    from zquant.metrics import perplexity
    from zquant.serialize import load_quantized

    model, tokenizer = load_quantized(model_dir), load_tokenizer(model_dir)
    text_ = text.read_text(encoding="utf-8")
    return float(perplexity(model, tokenizer, text_, max_tokens=PPL_TOKENS, window=WINDOW))


def text_ids(model_dir: Path, text: Path) -> list[int]:
    """The token ids `z eval` scores (zquant's tokenizer, no special tokens)."""
    from zquant.hf import load_tokenizer

    ids: list[int] = load_tokenizer(model_dir)(
        text.read_text(encoding="utf-8"), add_special_tokens=False
    )["input_ids"]
    return ids


def _check_served(engine: Engine, kernel: str) -> None:
    q = engine.runner.model.quantization
    assert q is not None and len(q.served) == QUANTIZED_LAYERS
    assert all(v.endswith(kernel) for v in q.served.values()), q.served
    # the skipped layers (and nothing else) are served in full precision, as stored
    assert len(q.fallback) == 26 * 7 and all(n.startswith("model.layers.") for n in q.fallback)
    assert set(q.fallback.values()) == {torch.float32}


@pytest.mark.parametrize(
    ("recipe", "kernel", "budget", "rtol"),
    [
        ("w8a8", "int8_linear", PPL_TOKENS, RTOL),
        ("w8a8", "int8_linear", WINDOW, RTOL_BATCHING),
        ("w6a16", "dequant_linear", WINDOW // 2, RTOL),
    ],
)
def test_served_perplexity_equals_z_eval(
    request, text_file, recipe: str, kernel: str, budget: int, rtol: float
) -> None:
    model_dir = request.getfixturevalue("w8a8_dir" if recipe == "w8a8" else "fp6_dir")
    engine = Engine(model_dir, token_budget=budget, max_model_len=WINDOW + 32)
    _check_served(engine, kernel)
    served = served_perplexity(
        engine, text_ids(model_dir, text_file), max_tokens=PPL_TOKENS, window=WINDOW
    )
    want = z_eval_ppl(model_dir, text_file)
    print(
        f"{recipe} token_budget {budget}: served {served} z eval {want} rel {served / want - 1:.2e}"
    )
    assert served == pytest.approx(want, rel=rtol), (served, want)
    assert 10 < served < 200  # a real model on real text


@pytest.mark.parametrize("fixture", ["w8a8_dir", "fp6_dir"])
def test_greedy_generation_is_sensible(request, fixture: str) -> None:
    model_dir = request.getfixturevalue(fixture)
    engine = Engine(model_dir, max_model_len=128)
    engine.add_request("r", "The capital of France is", SamplingParams(max_tokens=8, temperature=0))
    text = ""
    while engine.has_unfinished():
        text += "".join(o.text for o in engine.step())
    assert "Paris" in text, text


@pytest.mark.parametrize("fixture", ["w8a8_dir", "fp6_dir"])
def test_decode_program_equals_the_per_op_forward(request, fixture: str) -> None:
    """A decode step as direct kernel calls (zserve.model.native_decode: the quantized layers'
    bound INT8 / dequantize-GEMM calls) gives the per-op forward's logits bit for bit, at one
    decoding sequence and at three. The skipped layers run F.linear inside a module in a
    quantized directory, which the program does not cover (None); made plain matrices here
    on both sides (what the per-op path runs on `znative.linear_rows`), the program runs."""
    from zserve.model.native_decode import DecodeProgram
    from zserve.model.quantized import DenseLinear
    from zserve.runner import ModelRunner, SeqChunk

    model_dir = request.getfixturevalue(fixture)
    fast, ref = (ModelRunner(model_dir, num_blocks=8, block_size=16) for _ in range(2))
    assert fast.model.decode_program is None  # the kept layers' F.linear
    for model in (fast.model, ref.model):
        for layer in model.layers:
            for owner, name in (
                (layer, "qkv"),
                (layer, "o"),
                (layer.mlp, "gate_up"),
                (layer.mlp, "down"),
            ):
                if isinstance(w := getattr(owner, name), DenseLinear):
                    assert w.bias is None
                    setattr(owner, name, w.weight)
    program = fast.model.decode_program = DecodeProgram.build(fast.model)
    assert program is not None
    ref.model.decode_program = None
    tables = [[2 * s, 2 * s + 1] for s in range(3)]
    steps = [[SeqChunk(s, list(range(100 + s, 120 + s)), 0, tables[s]) for s in range(3)]]
    steps += [[SeqChunk(0, [5], 20, tables[0])]]
    steps += [[SeqChunk(s, [7 + s], 20 + (s == 0), tables[s]) for s in range(3)]]
    ran, run = [], program.run
    program.run = lambda *args: ran.append(1) or run(*args)  # type: ignore[method-assign]
    for chunks in steps:
        assert torch.equal(fast.forward(chunks), ref.forward(chunks))
    assert len(ran) == 2  # the decode steps
    assert torch.equal(fast.kv_cache._storage, ref.kv_cache._storage)


def test_fused_projection_equals_its_parts() -> None:
    """q/k/v (and gate/up) share one packed weight: rows concatenated, outputs identical."""
    from zquant.nn import OutlierQuantLinear, QuantLinear
    from zquant.quantizers import QuantSpec
    from zserve.model.quantized import QuantizedLinears

    torch.manual_seed(0)
    x = torch.randn(5, 64)
    for spec, act, outliers in [
        (QuantSpec(bits=8, granularity="channel"), 8, 4),
        (QuantSpec(bits=4, granularity="group", group_size=32), 8, 0),
        (QuantSpec(bits=6, fmt="fp6", granularity="channel"), None, 0),
    ]:
        parts = []
        for rows in (48, 16, 16):
            lin = torch.nn.Linear(64, rows, bias=False)
            cls = OutlierQuantLinear if outliers else QuantLinear
            layer = cls.from_linear(lin, spec, act)
            if outliers:
                layer.set_outliers(outliers)
            layer.backend = "native"
            parts.append(layer)
        fused = QuantizedLinears(Path("."), {}, {})._fuse(parts, "qkv")
        assert fused is not None and fused.backend == "native"
        want = torch.cat([p(x) for p in parts], dim=-1)
        torch.testing.assert_close(fused(x), want, atol=1e-6, rtol=0)


def test_pruned_w4a8_with_bf16_fallback(tmp_path, text_file) -> None:
    """Row-pruned MLP (redundancy_clean) + W4A8 on layers 0-1 + layer 2's MLP stored in bf16:
    served at the stored widths and dtypes, perplexity equal to zquant's loader (`z eval`)."""
    from zquant.clean import redundancy_clean
    from zquant.hf import load_model, load_tokenizer
    from zquant.metrics import perplexity
    from zquant.nn import QuantLinear
    from zquant.pruning import prune_rows
    from zquant.ptq import quantize
    from zquant.schemes import get_recipe
    from zquant.serialize import load_quantized, save_quantized

    model = load_model(smollm2_dir())
    prune_rows(model.model.layers[1].mlp.up_proj, dense_ratio=0.75)
    redundancy_clean(model)
    recipe = get_recipe("w4a8", skip=(r"re:model\.layers\.([2-9]|[12]\d)\..*",))
    quantize(model, recipe)
    model.model.layers[2].mlp.to(torch.bfloat16)
    out = save_quantized(model, tmp_path / "pruned", recipe=recipe, source_dir=smollm2_dir())
    del model

    engine = Engine(out, token_budget=PPL_TOKENS, max_model_len=WINDOW + 32)
    q = engine.runner.model.quantization
    assert q is not None and len(q.served) == 2 * 7
    assert q.served["model.layers.1.mlp.up_proj"] == "int4 sym group32 a8 -> dequant_linear"
    assert q.served["model.layers.0.self_attn.q_proj"] == "int8 sym channel a8 -> int8_linear"
    assert q.fallback["model.layers.2.mlp.down_proj"] == torch.bfloat16
    assert engine.runner.model.layers[1].mlp.down.in_features == 1152  # 3/4 of 1536 rows kept
    served = served_perplexity(
        engine, text_ids(out, text_file), max_tokens=PPL_TOKENS, window=WINDOW
    )
    want = z_eval_ppl(out, text_file)
    print(f"pruned w4a8: served {served} z eval {want} rel {served / want - 1:.2e}")
    assert served == pytest.approx(want, rel=RTOL_KERNELS)
    # zquant's own loader with the kernels zserve runs: the same numbers
    reference = load_quantized(out)
    for module in reference.modules():
        if isinstance(module, QuantLinear):
            module.backend = "native"
    same_kernels = perplexity(
        reference, load_tokenizer(out), text_file.read_text(), max_tokens=PPL_TOKENS, window=WINDOW
    )
    assert served == pytest.approx(same_kernels, rel=RTOL)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory) -> Path:
    """SmolLM2 with only its tied LM head quantized (INT8, W8A8); the embedding stays fp32."""
    return _quantize(tmp_path_factory, "w4", lm_head="int8", skip=("model.layers.*",))


def test_quantized_lm_head_served_as_z_eval_scores_it(head_dir, text_file) -> None:
    from zquant.nn import QuantLinear
    from zserve.model.quantized_bound import BoundLinear

    want = z_eval_ppl(head_dir, text_file)
    for budget, rtol in [(PPL_TOKENS, RTOL), (WINDOW, RTOL_BATCHING)]:
        engine = Engine(head_dir, token_budget=budget, max_model_len=WINDOW + 32)
        model = engine.runner.model
        q = model.quantization
        assert q is not None and q.served == {"lm_head": "int8 sym channel a8 -> int8_linear"}
        assert isinstance(model.lm_head, BoundLinear)  # its kernel arguments bound once
        assert isinstance(model.lm_head.layer, QuantLinear) and model.lm_head.backend == "native"
        assert model.embed.dtype == torch.float32 and model.embed.shape == (49152, 576)
        served = served_perplexity(
            engine, text_ids(head_dir, text_file), max_tokens=PPL_TOKENS, window=WINDOW
        )
        print(
            f"int8 head, token_budget {budget}: served {served} z eval {want} "
            f"rel {served / want - 1:.2e}"
        )
        assert served == pytest.approx(want, rel=rtol), (budget, served, want)
        assert 10 < served < 200


def _small_copy(src: Path, dst: Path) -> Path:
    """`src` without its weights (config, tokenizer, manifest)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    return dst


def test_bad_directories_fail_clearly(tmp_path, w8a8_dir) -> None:
    from zquant.hf import load_model
    from zquant.ptq import quantize
    from zquant.schemes import get_recipe
    from zquant.serialize import save_quantized

    missing = _small_copy(w8a8_dir, tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        Engine(missing)

    # a manifest zserve's zquant does not read: its path and the fix
    bumped = tmp_path / "bumped"
    shutil.copytree(w8a8_dir, bumped)
    manifest = json.loads((bumped / "zquant.json").read_text())
    (bumped / "zquant.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(OSError, match="format_version 99"):
        Engine(bumped)

    # a scheme without a native kernel (INT8 weight-only) is refused, naming the layer
    model = load_model(smollm2_dir())
    recipe = get_recipe("w8", skip=(r"re:model\.layers\.([1-9]|[12]\d)\..*",))
    quantize(model, recipe)
    w8 = save_quantized(model, tmp_path / "w8", recipe=recipe, source_dir=smollm2_dir())
    with pytest.raises(QuantizedModelError, match=r"model\.layers\.0\.self_attn\.q_proj.*int8"):
        Engine(w8)

    with pytest.raises(QuantizedModelError, match="device='cpu'"):
        Engine(w8a8_dir, device="cuda")
    with pytest.raises(ValueError, match="policy 'static'"):
        make_engine(w8a8_dir, policy="static")
