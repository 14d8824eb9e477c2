"""Mixtral through zserve against transformers' ``MixtralForCausalLM``.

A tiny random Mixtral (2 layers, hidden 64, 4 experts, top-2, SmolLM2's tokenizer and
vocabulary) is written by ``save_pretrained`` — the Mixtral checkpoint names,
``block_sparse_moe.experts.{e}.w1/w2/w3`` — and again as transformers-5's fused
``state_dict()`` (``mlp.experts.gate_up_proj``/``down_proj``). Both must give
transformers' logits for packed prompts and for chunked prefill through a shuffled block
table, and greedy decoding of a ragged batch (through the engine, and through the HTTP
server) must reproduce ``generate(do_sample=False)`` token for token.

Tolerance: fp32 on CPU, max |logit difference| <= 1e-4 x max(1, max |logit|), as for the
tiny LLaMA checkpoints (measured ~5e-6 on logits up to ~8: the experts run as grouped
GEMMs over the token slots sorted by expert, so only summation order differs from
transformers).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import MixtralForCausalLM

from tests.utils.models import smollm2_dir
from tests.zserve.server.conftest import serving
from tests.zserve.tiny_llama import hf_greedy, tiny_mixtral
from zserve.engine import Engine
from zserve.model import LlamaConfig, LlamaModel, SparseMoE, WeightsMismatchError
from zserve.pipelines import pipeline
from zserve.runner import ModelRunner, SeqChunk

BLOCK, NUM_BLOCKS = 8, 64
# Lengths differ so one forward packs a long prompt chunk next to short ones.
PROMPT_LENS = (37, 5, 18, 1, 61)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> MixtralForCausalLM:
    """The random Mixtral; ``.saved`` is its save_pretrained dir, ``.fused`` the state_dict's."""
    saved = tmp_path_factory.mktemp("mixtral")
    vocab = json.loads((smollm2_dir() / "config.json").read_text())["vocab_size"]
    model = tiny_mixtral(saved, vocab_size=vocab, eos_token_id=2, bos_token_id=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir() / name, saved / name)
    fused = tmp_path_factory.mktemp("mixtral-fused")
    shutil.copy(saved / "config.json", fused / "config.json")
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, fused / "model.safetensors", metadata={"format": "pt"})
    model.saved, model.fused = saved, fused  # type: ignore[attr-defined]
    return model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in PROMPT_LENS]


def _assert_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    diff = (out - ref).abs().max().item()
    assert diff <= 1e-4 * max(1.0, ref.abs().max().item()), f"{what}: max |logit diff| {diff:.2e}"


def test_both_weight_layouts_are_on_disk(hf_model: MixtralForCausalLM) -> None:
    with safe_open(hf_model.saved / "model.safetensors", framework="pt") as f:
        saved = set(f.keys())
    with safe_open(hf_model.fused / "model.safetensors", framework="pt") as f:
        fused = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in saved
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    assert not any("experts.gate_up_proj" in k for k in saved)


@pytest.mark.parametrize("layout", ["saved", "fused"])
def test_logits_match_transformers(
    hf_model: MixtralForCausalLM, prompts: list[list[int]], layout: str
) -> None:
    runner = ModelRunner(getattr(hf_model, layout), num_blocks=NUM_BLOCKS, block_size=BLOCK)
    c = runner.config
    assert (c.model_type, c.num_local_experts, c.num_experts_per_tok) == ("mixtral", 4, 2)
    assert isinstance(runner.model.layers[1].mlp, SparseMoE)
    with torch.no_grad():
        ref = [hf_model(torch.tensor([ids])).logits[0] for ids in prompts]
    free = iter(random.Random(1).sample(range(NUM_BLOCKS), NUM_BLOCKS))
    tables = [[next(free) for _ in range(-(-len(p) // BLOCK))] for p in prompts]
    packed = runner.forward([SeqChunk(i, p, 0, tables[i]) for i, p in enumerate(prompts)])
    for i, r in enumerate(ref):
        _assert_close(packed[i], r[-1], f"{layout}: prompt {i} packed")
    # The longest prompt again, in chunks after cached tokens, next to another's decode.
    long, table = prompts[-1], [next(free) for _ in range(8)]
    runner.forward([SeqChunk(9, long[:20], 0, table)])
    out = runner.forward(
        [SeqChunk(9, long[20:45], 20, table), SeqChunk(0, prompts[0][-1:], 36, tables[0])]
    )
    _assert_close(out[0], ref[-1][44], f"{layout}: chunk [20, 45)")
    _assert_close(out[1], ref[0][-1], f"{layout}: decode next to the chunk")


def test_greedy_ragged_batch_matches_generate(
    hf_model: MixtralForCausalLM, prompts: list[list[int]]
) -> None:
    """All prompts enter the engine at once: prompt chunks and decodes share forwards."""
    pipe = pipeline(hf_model.saved, token_budget=48, num_blocks=NUM_BLOCKS)
    got = pipe(prompts, max_tokens=MAX_TOKENS, temperature=0)
    for ids, completion in zip(prompts, got, strict=True):
        assert completion.token_ids == hf_greedy(hf_model, ids, MAX_TOKENS), (
            f"prompt of {len(ids)} tokens"
        )


def test_http_completion_matches_the_engine(hf_model: MixtralForCausalLM) -> None:
    text = "To be, or not to be, that is the question"
    engine = Engine(hf_model.saved, num_blocks=NUM_BLOCKS)
    expected = pipeline(hf_model.saved, num_blocks=NUM_BLOCKS)(
        [text], max_tokens=MAX_TOKENS, temperature=0
    )[0]
    with serving(engine) as server:
        body = {"model": hf_model.saved.name, "prompt": text, "max_tokens": MAX_TOKENS}
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["text"] == expected.text
    assert answer["usage"]["completion_tokens"] == len(expected.token_ids)


def test_missing_expert_is_named(hf_model: MixtralForCausalLM, tmp_path: Path) -> None:
    shutil.copy(hf_model.saved / "config.json", tmp_path / "config.json")
    tensors = load_file(hf_model.saved / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        WeightsMismatchError,
        match=r"`model\.layers\.1\.block_sparse_moe\.experts\.3\.w3\.weight`.*missing",
    ):
        LlamaModel.from_dir(tmp_path)


def test_mixtral_config_errors_name_the_values() -> None:
    base = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 8}
    base.update(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    c = LlamaConfig.from_dict(base)  # transformers' defaults: 8 experts, top-2
    assert (c.num_local_experts, c.num_experts_per_tok) == (8, 2)
    with pytest.raises(ValueError, match=r"num_experts_per_tok 5 .*\[1, num_local_experts 4\]"):
        LlamaConfig.from_dict({**base, "num_local_experts": 4, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match=r"`num_local_experts` must be a positive integer; got 0"):
        LlamaConfig.from_dict({**base, "num_local_experts": 0})
    with pytest.raises(ValueError, match=r"'qwen2_moe'.*'llama', 'mistral', 'mixtral'"):
        LlamaConfig.from_dict({**base, "model_type": "qwen2_moe"})
