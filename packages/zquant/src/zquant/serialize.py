"""Save and load quantized models: safetensors with the packed weights, plus a manifest.

A saved model is a directory:

- `model.safetensors`: the model's `state_dict()`; for every `QuantLinear` that is the packed
  form (`<layer>.qdata`, `.qscale`, `.qmeta`, ... see `QuantizedWeight.to_state`), so the
  file is the compressed model. Tied tensors are stored once.
- `zquant.json`: the manifest: format version, model kind, the recipe, every quantized
  layer with its spec and activation bits, tied-tensor aliases, and the SHA-256 of
  `model.safetensors` (the same JSON sits in the safetensors metadata under `zquant`).
- `config.json` and the tokenizer files copied from the source model.

A tied LM head quantized by the recipe (`Recipe.lm_head="int8"`) is a `QuantLinear` of its
own: `lm_head.qdata` (int8, one row per token, per-row scales in `lm_head.qscale`) is stored
beside the full-precision `model.embed_tokens.weight`, and the two are no longer aliases.
Per row, not per 32-block as llama.cpp's Q8_0: the INT8 GEMM applies one weight scale per
output row in its epilogue, so the head runs on the kernel W8A8's projections use. The input
embedding keeps its own full-precision table: a lookup reads only the looked-up rows, so
its bytes per token are nothing beside the head's full read, and the input side stays exact.

`load_quantized` rebuilds the architecture from `config.json` (transformers), swaps in
`QuantLinear`s from their saved state and loads the rest, so outputs are bit-identical to
the model that was saved. The directory is written to a temporary sibling and renamed into
place, so a crash never leaves a half-written model; a missing, truncated or altered file
fails with its path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zquant.hf import read_json_object
from zquant.nn import OutlierQuantLinear, QuantLinear
from zquant.schemes import Recipe
from zquant.swap import get_submodule_parent, quantized_layers

FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
MANIFEST = "zquant.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _dedupe(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors without shared storage (safetensors refuses aliases) and {alias: stored key}."""
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    out, aliases = {}, {}
    for key, tensor in state.items():
        ident = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.dtype,
        )
        if tensor.numel() and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        out[key] = tensor.detach().contiguous()
    return out, aliases


def save_quantized(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    recipe: Recipe | None = None,
    source_dir: str | os.PathLike[str] | None = None,
    kind: str | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `model` (with its `QuantLinear`s) to `out_dir` atomically; returns the path.

    `source_dir`: the Hugging Face directory it was loaded from; its `config.json` and
    tokenizer files are copied (needed by `load_quantized`). `kind` (`encoder`/`causal`)
    defaults to what `source_dir`'s config says. `extra` goes into the manifest as is (e.g.
    whether LKD ran).
    """
    from safetensors.torch import save_file

    from zquant.hf import model_kind, save_pretrained_files

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    if kind is None and source_dir is not None:
        kind = model_kind(source_dir)
    layers = quantized_layers(model)
    tensors, aliases = _dedupe(model.state_dict())
    manifest: dict[str, Any] = {
        "format": "zquant",
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "recipe": None if recipe is None else recipe.to_dict(),
        "layers": {
            name: {
                "weight": layer.spec.to_dict(),
                "act_bits": layer.act_bits,
                "act_outliers": getattr(layer, "act_outliers", 0),
            }
            for name, layer in layers.items()
        },
        "aliases": aliases,
        "extra": extra or {},
    }
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"zquant": json.dumps(manifest)})
        manifest["sha256"] = {WEIGHTS: _sha256(tmp / WEIGHTS)}
        manifest["files"] = [WEIGHTS]
        if source_dir is not None:
            manifest["files"] += save_pretrained_files(source_dir, tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace_dir(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` is moved aside first and removed after."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def read_manifest(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The `zquant.json` of a saved model; a missing or unreadable manifest names its path."""
    path = Path(model_dir) / MANIFEST
    manifest = read_json_object(
        path,
        missing=f"`{path}` is missing; `{model_dir}` is not a zquant model "
        "(write one with `z quantize` or zquant.save_quantized)",
        fix="re-run `z quantize`",
    )
    if manifest.get("format") != "zquant":
        raise OSError(f"`{path}` is not a zquant manifest; re-run `z quantize`")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise OSError(
            f"`{path}` has format_version {manifest.get('format_version')!r}, this zquant reads "
            f"{FORMAT_VERSION}; re-quantize with this version"
        )
    return manifest


def load_state(
    model_dir: str | os.PathLike[str], manifest: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The checked tensors of `model.safetensors` (aliases restored)."""
    from safetensors.torch import load_file

    path = Path(model_dir) / WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"`{path}` is missing; re-run `z quantize` to write it")
    expected = manifest.get("sha256", {}).get(WEIGHTS)
    if expected is not None and _sha256(path) != expected:
        raise OSError(
            f"`{path}` is corrupted: its SHA-256 does not match `{MANIFEST}`; "
            "re-run `z quantize` or restore the file"
        )
    try:
        state = load_file(str(path))
    except Exception as exc:  # safetensors raises its own SafetensorError on a bad header
        raise OSError(
            f"`{path}` is not a readable safetensors file ({exc}); re-run `z quantize`"
        ) from exc
    for alias, key in manifest.get("aliases", {}).items():
        state[alias] = state[key]
    return state


def load_quantized(model_dir: str | os.PathLike[str]) -> nn.Module:
    """Rebuild the model saved by `save_quantized` in `model_dir` (eval mode, CPU)."""
    from zquant.hf import _transformers, read_config

    manifest = read_manifest(model_dir)
    state = load_state(model_dir, manifest)
    transformers = _transformers()
    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    read_config(model_dir)  # a clear error if config.json is missing
    auto = (
        transformers.AutoModelForCausalLM
        if manifest.get("kind") == "causal"
        else transformers.AutoModel
    )
    model = auto.from_config(config, dtype=torch.float32)
    for name in manifest["layers"]:
        prefix = name + "."
        sub = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if not sub:
            raise OSError(
                f"`{Path(model_dir) / WEIGHTS}` has no tensors for quantized layer {name!r}; "
                "the file does not belong to this manifest, re-run `z quantize`"
            )
        parent, child = get_submodule_parent(model, name)
        if "qoutliers" in sub:
            layer = OutlierQuantLinear.from_state(sub, name=name)
            assert isinstance(layer, OutlierQuantLinear)
            layer.set_outliers(int(sub["qoutliers"]))
        else:
            layer = QuantLinear.from_state(sub, name=name)
        setattr(parent, child, layer)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("position_ids")]:
        raise OSError(
            f"`{Path(model_dir) / WEIGHTS}` does not fit the model in config.json: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}; re-run `z quantize`"
        )
    model.eval()
    return model
