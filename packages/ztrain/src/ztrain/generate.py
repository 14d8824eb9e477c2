"""Sampling from a trained GPT, and the export directory it is loaded from.

Export format (one directory, written by `export_dir`, read by `load_for_generation`):

    model.json         GPTConfig fields as a JSON object (`GPTConfig.to_dict`)
    tokenizer.json     the Hugging Face `tokenizers` file (`Tokenizer.save`)
    model.safetensors  the fp32 `GPT.state_dict()`, CPU, contiguous; with
                       `tie_weights` the shared `lm_head.weight` is left out
                       (it is `transformer.wte.weight`) because safetensors
                       stores no aliases

`load_for_generation` also takes a plain `state_dict` file (`.pt`, read with
`torch.load(weights_only=True)`, or `.safetensors`) with `model.json` and
`tokenizer.json` beside it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ztrain.atomic_dir import write_dir_atomically
from ztrain.gpt import GPT, GPTConfig
from ztrain.tokenizer import Tokenizer

MODEL_JSON = "model.json"
TOKENIZER_JSON = "tokenizer.json"
WEIGHTS = "model.safetensors"
_TIED_KEY = "lm_head.weight"
_EMBEDDING_KEY = "transformer.wte.weight"


@torch.no_grad()
def generate(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int | None = None,
) -> str:
    """`prompt` followed by `max_new_tokens` sampled tokens, decoded.

    The context is cropped to the last `block_size` tokens; an empty prompt starts
    from `<|endoftext|>` (not part of the returned text). `temperature == 0` is
    greedy; `seed` makes sampling reproducible (a private generator, global RNG
    untouched). The model is put in eval mode for the call and restored after.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    prompt_ids = tokenizer.encode(prompt)
    ids = torch.tensor([prompt_ids or [tokenizer.eot_id]], dtype=torch.long, device=device)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    block_size = model.config.block_size
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits, _ = model(ids[:, -block_size:])
            logits = logits[:, -1, :]  # (1, vocab)
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.size(-1):
                    kth = torch.topk(logits, top_k).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, 1, generator=generator)
            ids = torch.cat([ids, next_id], dim=1)
    finally:
        model.train(was_training)
    new_ids = ids[0, (len(prompt_ids) or 1) :].tolist()
    return tokenizer.decode([*prompt_ids, *new_ids])


def _weights_for_export(
    state_dict: Mapping[str, torch.Tensor], config: GPTConfig
) -> dict[str, torch.Tensor]:
    out = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state_dict.items()}
    if config.tie_weights and _TIED_KEY in out:
        head = out.pop(_TIED_KEY)
        if _EMBEDDING_KEY in out and not torch.equal(head, out[_EMBEDDING_KEY]):
            raise ValueError(
                f"tie_weights is set but {_TIED_KEY} differs from {_EMBEDDING_KEY} "
                f"(max abs diff {(head - out[_EMBEDDING_KEY]).abs().max().item():g})"
            )
    # Clones, so no two entries share storage (save_file refuses aliases).
    return {k: v.clone() for k, v in out.items()}


def export_dir(
    model_state_dict: Mapping[str, torch.Tensor],
    gpt_config: GPTConfig,
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike[str],
) -> Path:
    """Write the export directory (see module docstring) atomically; return its path.

    Files go to a temporary sibling directory, are fsynced, and the directory is
    renamed into place; an existing `out_dir` is replaced only after that.
    """
    weights = _weights_for_export(model_state_dict, gpt_config)

    def fill(tmp: Path) -> None:
        (tmp / MODEL_JSON).write_text(json.dumps(gpt_config.to_dict(), indent=2) + "\n")
        tokenizer.save(tmp / TOKENIZER_JSON)
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})

    return write_dir_atomically(out_dir, fill)


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A flat fp32 state_dict from `.safetensors` or `.pt` (`weights_only=True`)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return load_file(str(path), device="cpu")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"`{path}` is not a flat state_dict of tensors")
    return state


def load_for_generation(path: str | os.PathLike[str]) -> tuple[Any, Tokenizer]:
    """(GPT or MoELM in eval mode on CPU, tokenizer) from an export directory or a weights file.

    A file (`.safetensors` or `.pt`) needs `model.json` and `tokenizer.json` in its
    directory; a directory needs those and `model.safetensors`.
    """
    path = Path(path)
    weights = path / WEIGHTS if path.is_dir() else path
    folder = weights.parent
    missing = [
        p.name for p in (weights, folder / MODEL_JSON, folder / TOKENIZER_JSON) if not p.is_file()
    ]
    if missing:
        raise FileNotFoundError(f"`{folder}` lacks {', '.join(missing)}; write it with export_dir")
    from ztrain.moe_plan import build_model, config_from_dict

    config = config_from_dict(json.loads((folder / MODEL_JSON).read_text()), ep_size=1)
    tokenizer = Tokenizer.load(folder / TOKENIZER_JSON)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is {config.vocab_size}"
        )
    state = read_state_dict(weights)
    if config.tie_weights:
        state.pop(_TIED_KEY, None)
        if _EMBEDDING_KEY in state:
            state[_TIED_KEY] = state[_EMBEDDING_KEY]
    model = build_model(config)
    model.load_state_dict(state, strict=True)
    model.eval()
    return model, tokenizer
