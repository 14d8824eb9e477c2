"""zserve.model.native_decode: a decode step run as direct kernel calls on views taken once
gives the per-op native forward's logits and KV cache bit for bit (atol 0), fp32 and bf16,
for one decoding sequence and for several; steps it does not cover (a prompt chunk, more
rows than its buffers) take the per-op path. Quantized directories: test_quantized_serving."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.zserve.tiny_llama import tiny_llama
from zserve.model.native_decode import DecodeProgram
from zserve.runner import ModelRunner, SeqChunk


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-decode")
    tiny_llama(out)
    return out


class Counting:
    """Counts the steps a program ran (a spy around the real run)."""

    def __init__(self, program: DecodeProgram) -> None:
        self.program, self.steps = program, 0
        self.run = program.run

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        self.steps += 1
        return self.run(*args, **kwargs)


def _pair(model_dir: Path, dtype: torch.dtype) -> tuple[ModelRunner, ModelRunner, Counting]:
    fast = ModelRunner(model_dir, num_blocks=32, block_size=4, dtype=dtype)
    ref = ModelRunner(model_dir, num_blocks=32, block_size=4, dtype=dtype)
    assert fast.model.decode_program is not None, "a plain CPU model must get a program"
    ref.model.decode_program = None  # every step on the per-op path
    spy = Counting(fast.model.decode_program)
    fast.model.decode_program.run = spy  # type: ignore[method-assign]
    return fast, ref, spy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_program_equals_the_per_op_forward(model_dir: Path, dtype: torch.dtype) -> None:
    fast, ref, spy = _pair(model_dir, dtype)
    a, b, c = list(range(3, 14)), list(range(20, 26)), list(range(40, 49))
    tables = {0: [0, 1, 2, 3], 1: [4, 5, 6], 2: [7, 8, 9, 10]}
    steps = [
        [SeqChunk(0, a, 0, tables[0]), SeqChunk(1, b, 0, tables[1])],  # prompts: per-op
        [SeqChunk(0, [7], 11, tables[0])],  # one decode
        [SeqChunk(2, c, 0, tables[2])],
        [SeqChunk(s, [9 + s], n, tables[s]) for s, n in ((0, 12), (1, 6), (2, 9))],  # three
        [SeqChunk(s, [4 + s], n, tables[s]) for s, n in ((0, 13), (1, 7), (2, 10))],
        [SeqChunk(1, [5], 8, tables[1])],  # back to one: its own buffers again
    ]
    for chunks in steps:
        got, want = fast.forward(chunks), ref.forward(chunks)
        assert torch.equal(got, want), [ch.seq_id for ch in chunks]
    assert spy.steps == 4
    assert torch.equal(fast.kv_cache._storage, ref.kv_cache._storage)


def test_steps_it_does_not_cover(model_dir: Path) -> None:
    """More decoding rows than its buffers, or a decode beside a prompt chunk: per-op."""
    fast, ref, spy = _pair(model_dir, torch.float32)
    program = spy.program
    many = program.max_rows + 1
    prompts = [SeqChunk(s, [3 + s, 4, 5], 0, [s]) for s in range(many)]
    decodes = [SeqChunk(s, [6], 3, [s]) for s in range(many)]
    mixed = [SeqChunk(0, [7], 4, [0, 20]), SeqChunk(many, [8, 9], 0, [many])]
    for chunks in (prompts, decodes, mixed):
        assert torch.equal(fast.forward(chunks), ref.forward(chunks))
    assert spy.steps == 0
