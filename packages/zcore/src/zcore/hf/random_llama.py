"""A random LLaMA in Hugging Face's layout: its ``config.json`` dict and its state dict.

For quick runs that need a model directory transformers, zcore and zserve all load (tests,
a benchmark's tiny size) without downloading one. Weights are ``randn * std`` from a seeded
generator in a fixed order (embedding, head, final norm, then layer by layer), so the same
arguments give the same tensors; norms are ones. Nothing is written here: the caller saves
the state with the safetensors writer it has.
"""

from __future__ import annotations

from typing import Any

import torch


def random_llama(
    *,
    vocab: int,
    hidden: int,
    inter: int,
    layers: int,
    heads: int,
    kv_heads: int,
    std: float,
    max_positions: int,
    seed: int = 0,
    **config: Any,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, state)`` of a ``LlamaForCausalLM`` with untied head; ``config`` keywords
    (``rope_parameters``, ``bos_token_id``, ...) are added to the config as given."""
    head_dim = hidden // heads
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **config,
    }
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    state = {
        "model.embed_tokens.weight": w(vocab, hidden),
        "lm_head.weight": w(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    return cfg, state
