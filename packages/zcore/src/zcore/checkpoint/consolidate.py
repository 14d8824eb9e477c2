"""Turn a sharded checkpoint into one plain fp32 ``state_dict`` of the unwrapped model."""

from __future__ import annotations

from pathlib import Path

import torch

from zcore.checkpoint.files import CheckpointError, load_json, load_torch
from zcore.checkpoint.rank_files import file_pieces, listed_files
from zcore.checkpoint.sharded import FORMAT, resolve_tag
from zcore.zero.layout import GroupLayout, ParamShard


def consolidate(checkpoint_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 parameters (from the master weights), frozen parameters and buffers.

    Needs no process group and reads each rank file once. Tied parameters appear under
    every name the model uses, so ``model.load_state_dict(sd)`` works with ``strict=True``.
    """
    root = Path(checkpoint_dir)
    path = root / resolve_tag(root, tag)
    manifest = load_json(path / "manifest.json")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"`{path}` has format {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    layouts = [GroupLayout.from_json(g) for g in manifest["groups"]]
    # every slot of every parameter, from whichever rank file holds it
    slots: dict[str, tuple[ParamShard, dict[int, torch.Tensor]]] = {}
    for name in listed_files(manifest):
        shard = load_torch(path / name)
        for g, piece in enumerate(file_pieces(manifest, name, shard, layouts)):
            if piece is None:
                continue
            layout, rank = piece
            for s in layout.shards:
                slot = shard["master"][g][s.offset : s.offset + s.shard_size]
                slots.setdefault(s.name, (s, {}))[1][rank] = slot
    out: dict[str, torch.Tensor] = {}
    for s, held in slots.values():
        pieces = [held[r] for r in sorted(held)]
        out[s.name] = torch.cat(pieces)[: s.numel].view(s.shape).float().clone()
    common = load_torch(path / "common.pt")
    for name, value in common["frozen"].items():
        out[name] = value.float().clone() if value.is_floating_point() else value.clone()
    for name, value in common["buffers"].items():
        out[name] = value.clone()
    for alias, name in manifest["aliases"].items():
        if name in out:
            out[alias] = out[name]
    return out
