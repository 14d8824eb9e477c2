"""Layouts tensor parallelism cannot run fail at start, naming every number and the fix."""

from __future__ import annotations

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config
from zcore.comm import MeshError, MeshSpec
from zcore.tensor import parallelize, plan_for
from ztrain.gpt import GPT, GPTConfig


def test_gpt_heads_and_vocab_not_divisible() -> None:
    model = GPT(GPTConfig(vocab_size=97, n_layer=1, n_head=3, n_embd=48, block_size=8))
    plan = plan_for(model)
    assert plan.name == "gpt"
    problems = "\n".join(plan.problems(model, 2))
    assert "n_head 3 is not divisible by tp 2" in problems
    assert "vocab_size 97 is not divisible by tp 2" in problems
    assert "pad the vocabulary to a multiple of tp" in problems


def test_gpt_dropout_refused() -> None:
    model = GPT(GPTConfig(vocab_size=96, n_layer=1, n_head=2, n_embd=16, block_size=8, dropout=0.1))
    assert "dropout 0.1" in "\n".join(plan_for(model).problems(model, 2))


def test_gpt_with_a_non_dense_mlp_refused() -> None:
    model = GPT(GPTConfig(vocab_size=96, n_layer=2, n_head=2, n_embd=16, block_size=8))
    model.transformer.h[1].mlp = torch.nn.Identity()  # what an MoE layer would be to the plan
    problems = "\n".join(plan_for(model).problems(model, 2))
    assert "transformer.h.1.mlp is a Identity" in problems
    assert "tensor parallelism of MoE layers is not built" in problems


def test_llama_kv_heads_not_divisible() -> None:
    """The plan reads only the model's config (a real ``LlamaConfig``; building the model
    itself would import transformers' modeling code, ~10 s here)."""
    from transformers import LlamaConfig

    class Causal(torch.nn.Module):
        def __init__(self, cfg: LlamaConfig) -> None:
            super().__init__()
            self.config = cfg
            self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    cfg = LlamaConfig(
        vocab_size=98,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = Causal(cfg)
    plan = plan_for(model)
    assert plan.name == "llama"
    problems = "\n".join(plan.problems(model, 4))
    assert "num_key_value_heads 2 is not divisible by tp 4" in problems
    assert "vocab_size 98 is not divisible by tp 4" in problems
    assert "num_attention_heads" not in problems


def test_unknown_model_and_plan() -> None:
    with pytest.raises(ValueError, match="no tensor-parallel plan for Linear"):
        plan_for(torch.nn.Linear(2, 2))
    with pytest.raises(
        ValueError, match="no tensor-parallel plan named 'bert'; the plans are gpt, llama"
    ):
        plan_for(torch.nn.Linear(2, 2), "bert")


def _run(rank: int, world: int) -> dict[str, str]:
    out = {}
    bad = GPT(GPTConfig(vocab_size=97, n_layer=1, n_head=3, n_embd=48, block_size=8))
    try:
        parallelize(bad, MeshSpec.resolve(world, tp=2))
    except ValueError as err:
        out["parallelize"] = str(err)
    assert type(bad.transformer.wte) is torch.nn.Embedding  # nothing changed
    good = GPT(GPTConfig(vocab_size=96, n_layer=1, n_head=2, n_embd=16, block_size=8))
    parallelize(good, MeshSpec.resolve(world, tp=2))
    try:
        zcore.initialize(good, config=config(0, gas=1), mesh=MeshSpec.resolve(world))
    except MeshError as err:
        out["engine"] = str(err)
    return out


def test_bad_layouts_fail_at_start_on_two_ranks() -> None:
    for out in run_ranks(_run, 2):
        assert (
            "cannot cut GPT (config: GPTConfig) over tp 2 with the 'gpt' plan" in out["parallelize"]
        )
        assert "n_head 3" in out["parallelize"] and "vocab_size 97" in out["parallelize"]
        assert "was cut for tp 2 but the engine's mesh has tp 1" in out["engine"]
        assert "tp=1" in out["engine"] or "tp=2" in out["engine"]
