"""The engine on a CUDA device generates what it generates on the CPU: a random LLaMA in
fp32, greedy, both policies, prefix sharing and forced preemption (the paged-attention
decode kernel, `znative/cuda/kernels/paged_attention.cu`, serves the decodes when CuPy is
there; the torch path otherwise). Skipped without a GPU."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.zserve.fakes import FakeTokenizer
from zcore.hf.random_llama import random_llama
from zserve.config import EngineConfig
from zserve.engine import Engine
from zserve.runner import ModelRunner
from zserve.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config, state = random_llama(
        vocab=256,
        hidden=128,
        inter=256,
        layers=2,
        heads=4,
        kv_heads=2,
        std=0.2,
        max_positions=512,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    out = tmp_path_factory.mktemp("cuda-llama")
    (out / "config.json").write_text(json.dumps(config))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(37)]
    return [shared + [rng.randrange(256) for _ in range(rng.randint(1, 60))] for _ in range(12)]


def _generate(model_dir: Path, device: str, **config: object) -> tuple[list[list[int]], dict]:
    cfg = EngineConfig(token_budget=48, max_num_seqs=8, device=device, **config)
    runner = ModelRunner(
        model_dir, num_blocks=cfg.num_blocks, block_size=cfg.block_size, device=device
    )
    tokenizer = FakeTokenizer()
    tokenizer.vocab_size = 256  # the model's
    engine = Engine.from_parts(runner, tokenizer, cfg, "cuda-llama")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    prompts = _prompts()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.token_ids
    return [got[str(i)] for i in range(len(prompts))], engine.stats()


@pytest.mark.parametrize(
    "policy, prefix_caching, num_blocks, block_size",
    [
        ("splitfuse", True, 256, 16),
        ("prefill-first", False, 256, 16),
        ("splitfuse", False, 40, 4),  # 40 x 4 slots for 12 requests of up to 109: preemption
    ],
)
def test_cuda_engine_generates_what_the_cpu_engine_does(
    model_dir: Path, policy: str, prefix_caching: bool, num_blocks: int, block_size: int
) -> None:
    opts = dict(
        policy=policy, prefix_caching=prefix_caching, num_blocks=num_blocks, block_size=block_size
    )
    cpu, _ = _generate(model_dir, "cpu", **opts)
    cuda, stats = _generate(model_dir, "cuda", **opts)
    assert all(len(t) == MAX_TOKENS for t in cuda)
    for i, (c, g) in enumerate(zip(cpu, cuda, strict=True)):
        assert g == c, f"request {i}: cuda {g} != cpu {c}"
    assert stats["free_blocks"] == stats["total_blocks"] == num_blocks
    if num_blocks == 40:
        assert stats["num_preempted"] > 0, stats
    if prefix_caching:
        assert stats["prefix_hits"] > 0, stats
