"""Loading LLaMA checkpoints: tiny random transformers models (sharded, with biases and
LLaMA-3.1 rotary scaling) against transformers, and the errors for broken checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.zserve.tiny_llama import tiny_llama
from zserve.model import LlamaConfig, LlamaModel, WeightsMismatchError
from zserve.runner import ModelRunner, SeqChunk

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.parametrize(
    "overrides",
    [
        {"attention_bias": True, "rope_parameters": LLAMA3_ROPE},
        {"mlp_bias": True, "tie_word_embeddings": True, "num_key_value_heads": 4},
    ],
    ids=["llama3-rope-attention-bias", "mlp-bias-tied-mha"],
)
def test_tiny_sharded_llama_matches_transformers(tmp_path: Path, overrides: dict) -> None:
    model = tiny_llama(tmp_path, sharded=True, **overrides)
    assert model.config.num_hidden_layers == 2
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config = LlamaConfig.from_dir(tmp_path)
    expected_inv_freq = model.model.rotary_emb.inv_freq
    assert torch.allclose(config.inv_freq(), expected_inv_freq, rtol=1e-6, atol=0)
    runner = ModelRunner(tmp_path, num_blocks=24, block_size=8)
    ids = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    table = list(range(23, 4, -1))  # 19 blocks of 8, reversed
    a = runner.forward([SeqChunk(0, ids[:100], 0, table)])
    b = runner.forward([SeqChunk(0, ids[100:], 100, table)])
    for out, r in ((a[0], ref[99]), (b[0], ref[-1])):
        diff = (out - r).abs().max().item()
        assert diff <= 1e-4 * max(1.0, r.abs().max().item()), f"max |logit diff| {diff:.2e}"


def test_missing_weights_file_names_the_directory(tmp_path: Path) -> None:
    tiny_llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in .*safe_serial"):
        LlamaModel.from_dir(tmp_path)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    tiny_llama(tmp_path, sharded=True)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        ModelRunner(tmp_path, num_blocks=4)


def _rewrite(tmp_path: Path, edit: object) -> None:
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)  # type: ignore[operator]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    tiny_llama(tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        WeightsMismatchError, match=r"`model\.layers\.1\.mlp\.up_proj\.weight`.*missing"
    ):
        ModelRunner(tmp_path, num_blocks=4)
    assert issubclass(WeightsMismatchError, ValueError)


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path: Path) -> None:
    tiny_llama(tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(tmp_path, lambda t: t.__setitem__(name, torch.zeros(48, 64)))
    with pytest.raises(
        WeightsMismatchError, match=r"k_proj\.weight` .* shape \[48, 64\].*\[32, 64\]"
    ):
        ModelRunner(tmp_path, num_blocks=4)


def test_config_that_does_not_match_the_weights(tmp_path: Path) -> None:
    tiny_llama(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(WeightsMismatchError, match=r"`model\.layers\.2\.input_layernorm\.weight`"):
        ModelRunner(tmp_path, num_blocks=4)
