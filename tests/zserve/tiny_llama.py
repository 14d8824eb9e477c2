"""A tiny random LLaMA checkpoint written by transformers, for fast zserve tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM


def tiny_llama(out: Path, *, sharded: bool = False, **overrides: object) -> LlamaForCausalLM:
    """A 2-layer random LLaMA saved to ``out`` by transformers (weights ~N(0, 0.2))."""
    kwargs: dict[str, object] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(HFLlamaConfig(**kwargs)).eval()
    with torch.no_grad():
        for p in model.parameters():  # biases and norms too, so every tensor matters
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 and p.numel() == 64 else 0))
    model.save_pretrained(out, max_shard_size="100KB" if sharded else "1GB")
    return model
