"""Tiny random LLaMA and Mixtral checkpoints written by transformers, for fast zserve tests,
and transformers' greedy decoding to hold zserve to."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, PreTrainedModel

M = TypeVar("M", bound=PreTrainedModel)

SIZES: dict[str, object] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _random_saved(build: Callable[[], M], out: Path, max_shard_size: str) -> M:
    """``build()``'s model with weights ~N(0, 0.2) (norms ~N(1, 0.2)), saved to ``out``."""
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        for p in model.parameters():  # biases and norms too, so every tensor matters
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 and p.numel() == 64 else 0))
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return model


def tiny_llama(out: Path, *, sharded: bool = False, **overrides: object) -> LlamaForCausalLM:
    """A 2-layer random LLaMA saved to ``out`` by transformers."""
    config = HFLlamaConfig(**{**SIZES, **overrides})
    return _random_saved(lambda: LlamaForCausalLM(config), out, "100KB" if sharded else "1GB")


def tiny_mixtral(out: Path, **overrides: object) -> MixtralForCausalLM:
    """A 2-layer random Mixtral, 4 experts, top-2, saved to ``out`` by transformers (which
    writes the checkpoint names ``block_sparse_moe.experts.{e}.w1/w2/w3``)."""
    config = MixtralConfig(
        **{**SIZES, "num_local_experts": 4, "num_experts_per_tok": 2, **overrides}
    )
    return _random_saved(lambda: MixtralForCausalLM(config), out, "1GB")


def hf_greedy(model: PreTrainedModel, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' ``generate(do_sample=False)`` tokens after the prompt ``ids`` (no padding;
    stops after EOS)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=2,
        )
    return out[0, len(ids) :].tolist()
