"""Load Hugging Face-format models and tokenizers (config.json + safetensors) for quantization.

`transformers` is imported only inside these functions (install the `hf` extra:
`pip install zquant[hf]`), so the quantizers and `QuantLinear` work without it.
Encoders (BERT family, e.g. all-MiniLM-L6-v2) load through `AutoModel`, decoders
(LLaMA/Mistral/GPT-2 families, e.g. SmolLM2) through `AutoModelForCausalLM`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

ModelKind = Literal["encoder", "causal"]

# `architectures` suffixes of decoder-only checkpoints; anything else with a config loads as an
# encoder through `AutoModel`.
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def read_json_object(path: Path, *, missing: str, fix: str) -> dict[str, Any]:
    """The JSON object in `path`. A missing file raises `FileNotFoundError(missing)`; an
    unreadable one, or one that holds no JSON object, `OSError` naming `path` and `fix`."""
    if not path.is_file():
        raise FileNotFoundError(missing)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OSError(f"`{path}` is corrupted ({exc}); {fix}") from exc
    if not isinstance(data, dict):
        raise OSError(f"`{path}` holds {type(data).__name__}, not a JSON object; {fix}")
    return data


def read_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed `config.json` of `model_dir`; a missing or unreadable file names the path."""
    return read_json_object(
        Path(model_dir) / "config.json",
        missing=f"no `config.json` in `{model_dir}`; pass a Hugging Face model directory "
        "(config.json + model.safetensors)",
        fix="re-download the model",
    )


def model_kind(model_dir: str | os.PathLike[str]) -> ModelKind:
    """`"causal"` for decoder-only checkpoints (by `architectures`), else `"encoder"`."""
    architectures = read_config(model_dir).get("architectures") or []
    if any(str(a).endswith(_CAUSAL_SUFFIXES) for a in architectures):
        return "causal"
    return "encoder"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "loading Hugging Face models needs `transformers`; run `pip install 'zquant[hf]'`"
        ) from exc
    transformers.logging.set_verbosity_error()
    # the per-tensor "Loading weights" bar would bury the CLI's and benchmark's own output
    transformers.utils.logging.disable_progress_bar()
    return transformers


def load_model(
    model_dir: str | os.PathLike[str],
    *,
    kind: ModelKind | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The model in `model_dir` in eval mode on the CPU, weights in `dtype`.

    `kind` defaults to `model_kind(model_dir)`: encoders load with `AutoModel` (the bare
    encoder, whose last hidden state is mean-pooled for sentence embeddings), decoders with
    `AutoModelForCausalLM`.
    """
    kind = model_kind(model_dir) if kind is None else kind
    if kind not in ("encoder", "causal"):
        raise ValueError(f"kind must be 'encoder' or 'causal', got {kind!r}")
    transformers = _transformers()
    auto = transformers.AutoModelForCausalLM if kind == "causal" else transformers.AutoModel
    model = auto.from_pretrained(str(model_dir), dtype=dtype)
    model.eval()
    return model


def load_tokenizer(model_dir: str | os.PathLike[str]) -> Any:
    """The fast tokenizer of `model_dir` (`AutoTokenizer`); pads on the right.

    Decoders without a pad token pad with their end-of-text token, which the attention
    mask hides anyway.
    """
    tokenizer = _transformers().AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_pretrained_files(model_dir: str | os.PathLike[str], out_dir: Path) -> list[str]:
    """Copy `config.json` and the tokenizer files of `model_dir` into `out_dir`; the names copied.

    These are what a quantized checkpoint needs beside its weights to be rebuilt and used.
    """
    import shutil

    names = []
    src = Path(model_dir)
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.txt",
        "chat_template.jinja",
    ):
        if (src / name).is_file():
            shutil.copyfile(src / name, out_dir / name)
            names.append(name)
    return names
