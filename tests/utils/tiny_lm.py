"""A tiny random LLaMA on disk for CLI smoke tests: what zserve and zquant load, in
milliseconds, with SmolLM2's tokenizer so prompts are real text."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.utils.models import smollm2_dir


def write_tiny_lm(out: Path) -> Path:
    """A 2-layer random LLaMA with SmolLM2's tokenizer (so prompts are real text): what
    zserve and zquant load, at a size that runs in milliseconds."""
    vocab, hidden, inter, layers, heads, kv_heads = 49152, 64, 96, 2, 4, 2
    head_dim = hidden // heads
    out.mkdir(parents=True)
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": vocab,
                "hidden_size": hidden,
                "intermediate_size": inter,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": kv_heads,
                "head_dim": head_dim,
                "max_position_embeddings": 1024,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "torch_dtype": "float32",
            }
        )
    )
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

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
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir() / name).is_file():
            (out / name).symlink_to(smollm2_dir() / name)
    return out
