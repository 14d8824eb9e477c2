"""Turn a sharded checkpoint into one plain fp32 ``state_dict`` of the unwrapped model."""

from __future__ import annotations

from pathlib import Path

import torch

from zcore.checkpoint.files import CheckpointError, load_json, load_torch
from zcore.checkpoint.rank_files import listed_files
from zcore.checkpoint.reshard import MASTER, SavedParams
from zcore.checkpoint.sharded import FORMAT, resolve_tag
from zcore.zero.layout import GroupLayout


def consolidate(checkpoint_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 parameters (from the master weights), frozen parameters and buffers.

    Names are those the checkpoint keys parameters by (:mod:`zcore.checkpoint.names`: the
    model's own, or those its ``checkpoint_names()`` gives). Works for a checkpoint of any
    layout, needs no process group and reads each rank file
    once: one tensor per parameter name, as the model has it before any parallelism cuts
    it. Tensor-parallel shards (the manifest's ``"params"``/``"tp_cuts"``) are reassembled
    into the tensors the model had before :func:`zcore.tensor.parallelize` cut it; a
    pipeline's parameters come from every stage under their layer names (``layers.<i>.…``,
    one copy of a tied layer), so a ``PipelineModule`` of one stage loads them. Tied
    parameters appear under every name the model uses, so ``model.load_state_dict(sd)``
    works with ``strict=True``.
    """
    root = Path(checkpoint_dir)
    path = root / resolve_tag(root, tag)
    manifest = load_json(path / "manifest.json")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"`{path}` has format {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    layouts = [GroupLayout.from_json(g) for g in manifest["groups"]]
    # every slot of every parameter, from whichever rank file holds it: tensor-parallel
    # shards by the tp coordinate of their file, the lowest pipeline stage's copy of a tie
    saved = SavedParams(path, manifest, listed_files(manifest), layouts)
    out: dict[str, torch.Tensor] = {}
    for name in saved.pieces:
        full = saved.full_tensor(name, MASTER)
        out[name] = full.float().clone() if full.dtype != torch.float32 else full
    common = load_torch(path / "common.pt")
    stages = saved.stage_model()  # later pipeline stages' frozen parameters and buffers
    common = {k: {**stages[k], **common[k]} for k in stages}
    for name, value in common["frozen"].items():
        out[name] = value.float().clone() if value.is_floating_point() else value.clone()
    for name, value in common["buffers"].items():
        out[name] = value.clone()
    for alias, name in manifest["aliases"].items():
        if name in out:
            out[alias] = out[name]
    return out
