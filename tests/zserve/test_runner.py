"""ModelRunner's input checks and its write discipline on a tiny random LLaMA (the
logits equivalence on the real SmolLM2 is in tests/zserve/model/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.zserve.tiny_llama import tiny_llama
from zserve.runner import ModelRunner, SeqChunk


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(path)
    return ModelRunner(path, num_blocks=8, block_size=4, max_model_len=64)


def test_sizes(runner: ModelRunner) -> None:
    assert (runner.num_blocks, runner.block_size, runner.max_model_len) == (8, 4, 64)
    # 2 (K and V) x 2 layers x 4 positions x 2 KV heads x head_dim 16 x 4 bytes
    assert runner.kv_bytes_per_block() == 2 * 2 * 4 * 2 * 16 * 4
    assert runner.forward([]).shape == (0, 128)


@pytest.mark.parametrize(
    ("chunk", "pattern"),
    [
        (SeqChunk(3, [], 0, [0]), r"sequence 3: empty chunk"),
        (SeqChunk(4, [1] * 9, 0, [0, 1]), r"sequence 4: block table has 2 .* need 3"),
        (SeqChunk(5, [1], 8, [0, 1]), r"start_pos 8 \+ 1 token\(s\) = 9 positions need 3"),
        (SeqChunk(6, [1, 2], 0, [8]), r"sequence 6: block id 8 is out of range \[0, 8\)"),
        (SeqChunk(7, [1], 64, [0] * 17), r"positions 64\.\.64 reach past max_model_len 64"),
        (SeqChunk(8, [1, 128], 0, [0]), r"token id 128 is out of range \[0, 128\)"),
        (SeqChunk(9, [1], -1, [0]), r"start_pos -1 is negative"),
    ],
)
def test_bad_chunks_raise_value_error_naming_the_problem(
    runner: ModelRunner, chunk: SeqChunk, pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        runner.forward([SeqChunk(1, [5, 6], 0, [2]), chunk])


def test_bad_construction_arguments(tmp_path: Path) -> None:
    tiny_llama(tmp_path)
    with pytest.raises(ValueError, match=r"max_model_len 1000 must be in \[1, 256\]"):
        ModelRunner(tmp_path, num_blocks=4, max_model_len=1000)
    with pytest.raises(ValueError, match=r"kv_cache_bytes 100 is less than one KV block"):
        ModelRunner(tmp_path, kv_cache_bytes=100)
    sized = ModelRunner(tmp_path, kv_cache_bytes=10 * 2048 + 5, block_size=4)
    assert sized.num_blocks == 10  # 2048-byte blocks


def test_forward_writes_only_its_own_positions(runner: ModelRunner) -> None:
    """Prefix caching shares full blocks: a chunk must not touch any other slot."""
    cache = runner.kv_cache
    for t in (*cache.keys, *cache.values):
        t.fill_(7.0)
    # Positions 5..10 of a sequence whose table is [6, 1, 3]: slots 1*4+1 .. 3*4+2.
    runner.forward([SeqChunk(0, [9, 8, 7, 6, 5, 4], 5, [6, 1, 3, 0])])
    written = {1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2}
    for t in (*cache.keys, *cache.values):
        flat = t.reshape(runner.num_blocks * runner.block_size, -1)
        changed = {i for i in range(flat.shape[0]) if not torch.all(flat[i] == 7.0)}
        assert changed == written


def test_bf16_runner_tracks_fp32(runner: ModelRunner) -> None:
    """bf16 weights, activations and KV cache: same argmax, logits within bf16 noise."""
    half = ModelRunner(runner.model_dir, num_blocks=8, block_size=4, dtype=torch.bfloat16)
    assert half.kv_bytes_per_block() == runner.kv_bytes_per_block() // 2
    ids = list(range(3, 40, 2))
    for r in (runner, half):
        r.forward([SeqChunk(0, ids[:11], 0, [5, 2, 7, 0, 1], want_logits=False)])
    ref = runner.forward([SeqChunk(0, ids[11:], 11, [5, 2, 7, 0, 1])])
    out = half.forward([SeqChunk(0, ids[11:], 11, [5, 2, 7, 0, 1])])
    assert out.dtype == torch.float32
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= 0.05 * scale
    assert out.argmax() == ref.argmax()
