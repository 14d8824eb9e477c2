"""Turn a sharded checkpoint into one plain fp32 ``state_dict`` of the unwrapped model."""

from __future__ import annotations

from pathlib import Path

import torch

from zcore.checkpoint.files import CheckpointError, load_json, load_torch
from zcore.checkpoint.sharded import FORMAT, rank_file, resolve_tag
from zcore.zero.layout import GroupLayout


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
    world = int(manifest["shard_world"])
    shards = [load_torch(path / rank_file(r))["master"] for r in range(world)]
    out: dict[str, torch.Tensor] = {}
    for g, layout in enumerate(layouts):
        for s in layout.shards:
            pieces = [shards[r][g][s.offset : s.offset + s.shard_size] for r in range(world)]
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
