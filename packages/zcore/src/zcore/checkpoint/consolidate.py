"""Turn a sharded checkpoint into one plain fp32 ``state_dict`` of the unwrapped model."""

from __future__ import annotations

from pathlib import Path

import torch

from zcore.checkpoint.files import CheckpointError, load_json, load_torch
from zcore.checkpoint.rank_files import file_pieces, listed_files
from zcore.checkpoint.sharded import FORMAT, resolve_tag
from zcore.tensor.cut import cut_from_json
from zcore.zero.layout import GroupLayout, ParamShard


def consolidate(checkpoint_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 parameters (from the master weights), frozen parameters and buffers.

    Needs no process group and reads each rank file once. Tied parameters appear under
    every name the model uses, so ``model.load_state_dict(sd)`` works with ``strict=True``.
    Tensor-parallel shards (the manifest's ``"tp_cuts"``) are reassembled into the tensors
    the model had before :func:`zcore.tensor.parallelize` cut it.
    """
    root = Path(checkpoint_dir)
    path = root / resolve_tag(root, tag)
    manifest = load_json(path / "manifest.json")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"`{path}` has format {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    layouts = [GroupLayout.from_json(g) for g in manifest["groups"]]
    cuts = manifest.get("tp_cuts") or {}
    coords = manifest.get("files") or {}
    # every slot of every parameter, from whichever rank file holds it; a tensor-parallel
    # shard's slots by the tp coordinate of the file too
    slots: dict[tuple[str, int], tuple[ParamShard, dict[int, torch.Tensor]]] = {}
    for name in listed_files(manifest):
        shard = load_torch(path / name)
        tp = int(coords.get(name, {}).get("tp", 0))
        for g, piece in enumerate(file_pieces(manifest, name, shard, layouts)):
            if piece is None:
                continue
            layout, rank = piece
            for s in layout.shards:
                slot = shard["master"][g][s.offset : s.offset + s.shard_size]
                key = (s.name, tp if s.name in cuts else 0)
                slots.setdefault(key, (s, {}))[1][rank] = slot
    out: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for (pname, tp), (s, held) in slots.items():
        pieces = [held[r] for r in sorted(held)]
        full = torch.cat(pieces)[: s.numel].view(s.shape).float().clone()
        if pname in cuts:
            shards.setdefault(pname, {})[tp] = full
        else:
            out[pname] = full
    for pname, by_tp in shards.items():
        out[pname] = cut_from_json(cuts[pname]).unshard([by_tp[r] for r in sorted(by_tp)])
    common = load_torch(path / "common.pt")
    for name, value in common["frozen"].items():
        out[name] = value.float().clone() if value.is_floating_point() else value.clone()
    for name, value in common["buffers"].items():
        out[name] = value.clone()
    for alias, name in manifest["aliases"].items():
        if name in out:
            out[alias] = out[name]
    return out
