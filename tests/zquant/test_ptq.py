"""ZeroQuant PTQ on the real all-MiniLM-L6-v2: embedding cosine against fp32 over 200 held-out
Shakespeare sentences, group sizes that do not divide a layer, and the one-layer-at-a-time
memory behaviour. SmolLM2 perplexity (slow) is at the end."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch import nn

from tests.utils.models import smollm2_dir
from tests.zquant.quant_utils import cosine, minilm, sentences, tokenizer
from zquant.lkd import calibration_batches
from zquant.nn import OutlierQuantLinear, QuantLinear
from zquant.ptq import model_size, quantize
from zquant.schemes import get_recipe
from zquant.swap import quantized_layers


def test_w8_weight_only_is_within_0_999():
    model = quantize(minilm(), get_recipe("w8"))
    assert len(quantized_layers(model)) == 36
    assert cosine(model) >= 0.999


def test_w8a8_runs_the_int8_path_and_meets_0_999():
    model = quantize(minilm(), get_recipe("w8a8"))
    layers = quantized_layers(model).values()
    assert {layer.path for layer in layers} == {"w8a8"}
    assert {layer.act_outliers for layer in layers} == {8}  # type: ignore[attr-defined]
    assert cosine(model) >= 0.999


def test_w8a8_without_outlier_channels_loses_more():
    """Plain token-wise INT8 activations (no channel kept in fp32) measured 0.9965: MiniLM's
    outlier channels, the value projection's input above all, take the per-token range."""
    plain = quantize(minilm(), dataclasses.replace(get_recipe("w8a8"), act_outliers=0))
    assert not any(isinstance(m, OutlierQuantLinear) for m in plain.modules())
    assert 0.99 <= cosine(plain) < 0.999


def test_fp6_weights_stay_close():
    model = quantize(minilm(), get_recipe("w6a16"))
    assert {layer.spec.fmt for layer in quantized_layers(model).values()} == {"fp6"}
    # Measured 0.9933: e3m2 keeps 2 mantissa bits, a 5.2% relative weight error on MiniLM
    # (INT8 per channel: 0.76%); see the slow test below for 0.998.
    assert cosine(model) >= 0.99


@pytest.mark.slow
def test_fp6_group32_with_gptq_and_scale_refits_meets_0_998():
    """Issue 6's FP6 target. Data-free per-channel e3m2 measures 0.9933 (above), LKD 0.996,
    GPTQ 0.9974, group 32 + GPTQ 0.9978; least-squares scale refits then take group 32 to
    0.99814 (1,024 calibration sentences, 3 refits, 2 threads; about a minute)."""
    calib = calibration_batches(tokenizer(), sentences("train", 1024))
    recipe = get_recipe("w6a16", group_size=32)
    model = quantize(minilm(), recipe, calib=calib, rounding="gptq", scale_refits=3)
    assert {layer.spec.fmt for layer in quantized_layers(model).values()} == {"fp6"}
    assert cosine(model) >= 0.998


def test_w4_group32_and_w4a8():
    w4 = quantize(minilm(), get_recipe("w4"))
    assert cosine(w4) >= 0.95
    w4a8 = quantize(minilm(), get_recipe("w4a8"))
    assert cosine(w4a8) >= 0.95


def test_size_counts_packed_bytes_and_scales():
    sizes = {n: model_size(quantize(minilm(), get_recipe(n))) for n in ("w8", "w4", "w6a16")}
    fp16 = sizes["w8"]["linear_fp16_bytes"]
    assert fp16 == 2 * 6 * (4 * 384 * 384 + 2 * 384 * 1536 + 4 * 384 + 1536 + 384)
    # INT8: half of fp16 plus a 4-byte scale per row and fp32 biases.
    assert 0.5 < sizes["w8"]["linear_bytes"] / fp16 < 0.52
    # INT4 group 32: 0.5 byte + 4/32 byte of scale per weight = 0.3125 of fp16's 2 bytes.
    assert 0.31 < sizes["w4"]["linear_bytes"] / fp16 < 0.33
    assert 0.375 < sizes["w6a16"]["linear_bytes"] / fp16 < 0.39


def test_group_size_that_does_not_divide_the_width_pads_the_last_group():
    # 100 divides neither 384 nor 1536: the last group of every row is padded.
    model = quantize(minilm(), get_recipe("w4", group_size=100))
    layer = quantized_layers(model)["encoder.layer.0.attention.self.query"]
    assert layer.qscale.shape == (384, 4)  # ceil(384 / 100) groups per row
    assert cosine(model) >= 0.9


def test_smollm2_group_128_on_576_wide_layers_runs_end_to_end():
    from zquant.hf import load_model

    model = load_model(smollm2_dir())
    ids = torch.tensor([[1, 504, 3458, 282, 3116, 314, 260, 1123, 30, 378, 1033, 28]])
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    quantize(model, get_recipe("w4", group_size=128))
    layer = quantized_layers(model)["model.layers.0.self_attn.q_proj"]
    assert layer.qscale.shape == (576, 5)  # 4.5 groups of 128 -> 5, the last padded
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean()
    assert torch.isfinite(out).all() and agree >= 0.5


def test_one_layer_at_a_time_frees_each_fp32_weight_as_it_goes():
    """After layer k is swapped, the live fp32 weights are exactly the layers not yet reached:
    quantization's memory above the model is set by one layer, and the fp32 footprint only
    shrinks."""
    model = minilm()
    recipe = get_recipe("w4")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    planned = [p.name for p in recipe.plan(model)]
    refs = {n: weakref.ref(linears[n].weight) for n in planned}
    nbytes = {n: linears[n].weight.numel() * linears[n].weight.element_size() for n in planned}
    del linears
    total = sum(nbytes.values())
    largest = max(nbytes.values())
    done: list[str] = []
    live_after: list[int] = []

    def on_layer(plan, qlinear):
        assert isinstance(qlinear, QuantLinear)
        done.append(plan.name)
        live = sum(nbytes[n] for n, r in refs.items() if r() is not None)
        live_after.append(live)
        assert live == total - sum(nbytes[n] for n in done), f"fp32 of {plan.name} still alive"

    quantize(model, recipe, on_layer=on_layer)
    assert done == planned and live_after[-1] == 0
    # Monotone decrease by one layer at a time: the step is never more than the largest layer.
    steps = [a - b for a, b in zip([total, *live_after], live_after, strict=False)]
    assert max(steps) == largest and min(steps) > 0


def _smollm2_ppl(recipe: str | None, group_size: int | None = None, gptq: int = 0) -> float:
    """Perplexity of SmolLM2 on 1,024 held-out tokens; `gptq` > 0 calibrates GPTQ (3 scale
    refits) on that many sentences of the other plays."""
    from zquant.hf import load_model, load_tokenizer
    from zquant.metrics import perplexity
    from ztrain.data import load_plays, split_plays

    text = split_plays(load_plays())[1][0][1]  # Julius Caesar, held out
    model = load_model(smollm2_dir())
    tok = load_tokenizer(smollm2_dir())
    if recipe is not None:
        options = {}
        if gptq:
            calib = calibration_batches(tok, sentences("train", gptq), max_length=128)
            options = {"calib": calib, "rounding": "gptq", "scale_refits": 3}
        quantize(model, get_recipe(recipe, group_size=group_size), **options)
    return perplexity(model, tok, text, max_tokens=1024)


@pytest.mark.slow
def test_smollm2_w8a8_perplexity_within_2_percent():
    # Measured: 41.28 vs 40.85 fp32 (+1.0%); without outlier channels +3.9%.
    ratio = _smollm2_ppl("w8a8") / _smollm2_ppl(None)
    assert abs(ratio - 1) <= 0.02, ratio


@pytest.mark.slow
@pytest.mark.timeout(1800)  # GPTQ over SmolLM2's 30 blocks: about 8 minutes on one thread
def test_smollm2_fp6_group32_with_gptq_perplexity_within_2_percent():
    """Data-free per-channel FP6 measured 42.71 vs 40.85 (+4.5%) here; group 32 + GPTQ with
    scale refits is the path that meets 2% (`z bench quant`: +0.8% on 4,096 tokens)."""
    ratio = _smollm2_ppl("w6a16", group_size=32, gptq=256) / _smollm2_ppl(None)
    assert abs(ratio - 1) <= 0.02, ratio


def test_outlier_quant_linear_still_imports_from_ptq_with_a_deprecation_warning():
    import zquant
    import zquant.ptq

    with pytest.warns(DeprecationWarning, match=r"import it from `zquant\.nn`"):
        from zquant.ptq import OutlierQuantLinear as old

    assert old is OutlierQuantLinear is zquant.OutlierQuantLinear
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        zquant.ptq.nothing  # noqa: B018
