"""Quantized models save to safetensors + manifest and reload bit-identically; a missing or
damaged file fails with its path."""

from __future__ import annotations

import json

import pytest
import torch

from tests.utils.models import minilm_dir, smollm2_dir
from tests.zquant.quant_utils import minilm, sentences, tokenizer
from zquant.hf import load_model
from zquant.nn import QuantLinear
from zquant.ptq import quantize
from zquant.schemes import Recipe, get_recipe
from zquant.serialize import MANIFEST, WEIGHTS, load_quantized, read_manifest, save_quantized
from zquant.swap import quantized_layers


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """MiniLM with W4A8 (INT4 groups of 100, padded; INT8 attention) saved once."""
    recipe = get_recipe("w4a8", group_size=100)
    model = quantize(minilm(), recipe)
    out = save_quantized(
        model, tmp_path_factory.mktemp("q") / "minilm-w4a8", recipe=recipe, source_dir=minilm_dir()
    )
    return model, recipe, out


def batch():
    return dict(tokenizer()(list(sentences("val", 8)), padding=True, return_tensors="pt"))


def test_reload_is_bit_identical_and_the_file_is_packed(saved):
    model, recipe, out = saved
    again = load_quantized(out)
    assert set(quantized_layers(again)) == set(quantized_layers(model))
    with torch.no_grad():
        assert torch.equal(model(**batch()).last_hidden_state, again(**batch()).last_hidden_state)
    manifest = read_manifest(out)
    assert Recipe.from_dict(manifest["recipe"]) == recipe and manifest["kind"] == "encoder"
    assert manifest["layers"]["encoder.layer.0.intermediate.dense"]["weight"]["group_size"] == 100
    assert {"config.json", "tokenizer.json", "vocab.txt"} <= set(manifest["files"])
    # The file holds the packed codes: INT4 layers take 4 bits a weight, not 32.
    size = (out / WEIGHTS).stat().st_size
    fp32 = sum(p.numel() * 4 for p in load_model(minilm_dir()).parameters())
    assert size < 0.75 * fp32


def test_tied_smollm2_round_trip(tmp_path):
    model = quantize(load_model(smollm2_dir()), get_recipe("w8a8"))
    out = save_quantized(
        model, tmp_path / "smol", recipe=get_recipe("w8a8"), source_dir=smollm2_dir()
    )
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    again = load_quantized(out)
    assert isinstance(again.model.layers[0].mlp.down_proj, QuantLinear)
    ids = torch.tensor([[1, 504, 3458, 282, 3116, 314, 260, 1123]])
    with torch.no_grad():
        a = model(input_ids=ids, use_cache=False).logits
        b = again(input_ids=ids, use_cache=False).logits
    assert torch.equal(a, b)


def test_save_is_atomic_and_replaces(saved, tmp_path):
    model, recipe, _ = saved
    out = tmp_path / "m"
    save_quantized(model, out, recipe=recipe, source_dir=minilm_dir())
    save_quantized(model, out, recipe=recipe, source_dir=minilm_dir())  # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp or old dirs left

    class Boom(RuntimeError):
        pass

    def fail(*_a, **_k):
        raise Boom

    import zquant.hf

    original = zquant.hf.save_pretrained_files
    zquant.hf.save_pretrained_files = fail
    try:
        with pytest.raises(Boom):
            save_quantized(model, out, recipe=recipe, source_dir=minilm_dir())
    finally:
        zquant.hf.save_pretrained_files = original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    load_quantized(out)  # the earlier save is intact


def test_missing_and_corrupted_files_are_named(saved, tmp_path):
    import shutil

    out = saved[2]

    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    data = bytearray((broken / WEIGHTS).read_bytes())
    data[-10] ^= 0xFF  # flip bits inside a tensor: only the checksum can tell
    (broken / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(OSError, match=rf"`{broken / WEIGHTS}` is corrupted: its SHA-256"):
        load_quantized(broken)
    (broken / WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError, match=rf"`{broken / WEIGHTS}` is missing"):
        load_quantized(broken)
    (broken / MANIFEST).write_text("{not json")
    with pytest.raises(OSError, match=rf"`{broken / MANIFEST}` is corrupted"):
        load_quantized(broken)
    (broken / MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match=rf"`{broken / MANIFEST}` is missing"):
        load_quantized(broken)


def test_tied_smollm2_with_an_int8_head(tmp_path):
    """`lm_head="int8"`: the tied head is stored INT8 per row beside the fp32 embedding table
    (no alias), reloads bit-identically, and stays close to the fp32 head's logits."""
    recipe = get_recipe("w8a8", lm_head="int8", skip=("model.layers.*",))  # the head alone
    fp32 = load_model(smollm2_dir())
    model = quantize(load_model(smollm2_dir()), recipe)
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.path == "w8a8"
    out = save_quantized(model, tmp_path / "smol-head", recipe=recipe, source_dir=smollm2_dir())
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["aliases"] == {} and list(manifest["layers"]) == ["lm_head"]
    assert manifest["recipe"]["lm_head"] == "int8"
    from safetensors import safe_open

    with safe_open(str(out / WEIGHTS), "pt") as f:
        assert f.get_slice("lm_head.qdata").get_dtype() == "I8"
        assert f.get_slice("lm_head.qdata").get_shape() == [49152, 576]
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    again = load_quantized(out)
    assert torch.equal(again.model.embed_tokens.weight, fp32.model.embed_tokens.weight)
    ids = torch.tensor([[1, 504, 3458, 282, 3116, 314, 260, 1123]])
    with torch.no_grad():
        a = model(input_ids=ids, use_cache=False).logits
        b = again(input_ids=ids, use_cache=False).logits
        ref = fp32(input_ids=ids, use_cache=False).logits
    assert torch.equal(a, b)
    # INT8 weights and activations (8 outlier channels kept): measured relative L2 error of
    # the logits 8.3e-3 (2.6e-2 with no outlier channels), the same top token everywhere
    err = ((b - ref).norm() / ref.norm()).item()
    print(f"int8 head vs fp32: relative L2 error of the logits {err:.2e}")
    assert err < 1.5e-2
    assert torch.equal(b.argmax(-1), ref.argmax(-1))
