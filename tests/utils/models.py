"""Where the real models fetched by `make setup` (tools/fetch_models.py) live.

The tests never skip for a missing model: CI runs `make test`, which fetches them, so a missing
directory is a set-up bug and fails with the command that fixes it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def models_root() -> Path:
    return Path(os.environ.get("ZSTACK_MODELS", Path.home() / ".cache" / "zstack" / "models"))


def _model(name: str) -> Path:
    path = models_root() / name
    if not (path / "config.json").is_file():
        pytest.fail(
            f"model {name} not found at {path}; run `make setup` (or "
            f"`python tools/fetch_models.py --out {models_root()}`)",
            pytrace=False,
        )
    return path


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain HF directory (fp32 safetensors, dequantized from Q4_1)."""
    return _model("SmolLM2-135M-Instruct")


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (BERT encoder, clean fp32 safetensors)."""
    return _model("all-MiniLM-L6-v2")
