"""Checkpoint readers: a model's tensors by name, from safetensors files or from memory.

Each reader checks a tensor's shape against what config.json implies and raises
:class:`WeightsMismatchError`, naming the tensor and both shapes, when they differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class WeightsMismatchError(ValueError):
    """The weights do not match config.json: a tensor is missing or has the wrong shape."""


class SafetensorsCheckpoint:
    """Tensors of a HF model directory by name, over one or several safetensors files."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.model_dir / f).is_file()]
            if missing:
                raise FileNotFoundError(
                    f"`{index}` lists shard(s) {missing} that are not in `{self.model_dir}`; "
                    "download the complete checkpoint"
                )
        else:
            files = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
            if not files:
                present = sorted(p.name for p in self.model_dir.iterdir())[:20]
                raise FileNotFoundError(
                    f"no *.safetensors weights in `{self.model_dir}` (found {present}); "
                    "zserve loads safetensors checkpoints: re-save the model with "
                    "`model.save_pretrained(dir, safe_serialization=True)`"
                )
        self._where: dict[str, str] = {}
        for name in files:
            with safe_open(self.model_dir / name, framework="pt") as f:
                for key in f.keys():
                    self._where[key] = name

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``name``, checked to have ``shape``; :class:`WeightsMismatchError` if not."""
        file = self._where.get(name)
        if file is None:
            raise WeightsMismatchError(
                f"tensor `{name}` (expected shape {list(shape)}) is missing from the "
                f"checkpoint in `{self.model_dir}`; does config.json match the weights?"
            )
        with safe_open(self.model_dir / file, framework="pt") as f:
            t = f.get_tensor(name)
        if tuple(t.shape) != tuple(shape):
            raise WeightsMismatchError(
                f"tensor `{name}` in `{file}` has shape {list(t.shape)}, but config.json "
                f"implies {list(shape)}; does config.json match the weights?"
            )
        return t


class TensorCheckpoint:
    """Tensors already in memory, by checkpoint name, read like :class:`SafetensorsCheckpoint`.

    For a caller that holds the weights itself (zchat's hybrid engine hands over the full
    values it gathered from ZeRO-3 partitions): a tensor already in the model's dtype and
    device and contiguous is used as it is, not copied (only the fused q/k/v and gate/up
    matrices are built by concatenation).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], model_dir: str | Path) -> None:
        self.tensors = tensors
        self.model_dir = Path(model_dir)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``name``, checked to have ``shape``; :class:`WeightsMismatchError` if not."""
        t = self.tensors.get(name)
        if t is None:
            raise WeightsMismatchError(
                f"tensor `{name}` (expected shape {list(shape)}) is not among the "
                f"{len(self.tensors)} tensors handed over; pass every weight config.json implies"
            )
        if tuple(t.shape) != tuple(shape):
            raise WeightsMismatchError(
                f"tensor `{name}` has shape {list(t.shape)}, but config.json implies "
                f"{list(shape)}; does config.json match the weights?"
            )
        return t


#: A checkpoint reader: ``name in reader`` and ``reader.get(name, shape)``; ``model_dir``
#: is where config.json (and a zquant directory's quantized layers) are.
Checkpoint = SafetensorsCheckpoint | TensorCheckpoint
