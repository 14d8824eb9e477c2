"""ModelRunner over weights handed over in memory (``weights=``, zchat's hybrid engine):
the same logits as reading the directory, the handed tensors used without a copy, and a
missing or misshapen tensor named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.zserve.tiny_llama import tiny_llama
from zserve.model.llama import WeightsMismatchError
from zserve.runner import ModelRunner, SeqChunk


def test_in_memory_weights_match_the_directory_and_are_not_copied(tmp_path: Path) -> None:
    tiny_llama(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    from_dir = ModelRunner(tmp_path, num_blocks=8, block_size=4)
    handed = ModelRunner(tmp_path, num_blocks=8, block_size=4, weights=weights)
    chunks = [SeqChunk(0, [3, 9, 27, 81], 0, [0]), SeqChunk(1, [5, 7], 0, [1])]
    torch.testing.assert_close(handed.forward(chunks), from_dir.forward(chunks), rtol=0, atol=0)
    # unfused tensors are the very tensors handed over (no second copy of the weights)
    assert handed.model.embed.data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    o = handed.model.layers[1].o
    assert isinstance(o, torch.Tensor)
    assert o.data_ptr() == weights["model.layers.1.self_attn.o_proj.weight"].data_ptr()


def test_missing_or_misshapen_weight_is_named(tmp_path: Path) -> None:
    tiny_llama(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    short = {k: v for k, v in weights.items() if k != name}
    with pytest.raises(WeightsMismatchError, match=name):
        ModelRunner(tmp_path, num_blocks=4, weights=short)
    bad = dict(weights) | {name: weights[name][:, :5]}
    with pytest.raises(WeightsMismatchError, match=rf"{name}` has shape \[64, 5\]"):
        ModelRunner(tmp_path, num_blocks=4, weights=bad)
