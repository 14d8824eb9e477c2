"""A tiny random LLaMA on disk for CLI smoke tests: what zserve and zquant load, in
milliseconds, with SmolLM2's tokenizer so prompts are real text."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from tests.utils.models import smollm2_dir
from zcore.hf.random_llama import random_llama


def write_tiny_lm(out: Path, heads: int = 4, kv_heads: int = 2) -> Path:
    """A 2-layer random LLaMA (16-wide heads) with SmolLM2's tokenizer (so prompts are real
    text): what zserve and zquant load, at a size that runs in milliseconds."""
    config, state = random_llama(
        vocab=49152,
        hidden=16 * heads,
        inter=96,
        layers=2,
        heads=heads,
        kv_heads=kv_heads,
        std=0.2,
        max_positions=1024,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        bos_token_id=1,
        eos_token_id=2,
    )
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir() / name).is_file():
            (out / name).symlink_to(smollm2_dir() / name)
    return out
