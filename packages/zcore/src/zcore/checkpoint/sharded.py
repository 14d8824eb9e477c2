"""Save and load an engine's state as one file per rank plus a manifest."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zcore.checkpoint.files import (
    CheckpointError,
    fsync_dir,
    load_json,
    load_torch,
    save_json,
    save_text,
    save_torch,
)
from zcore.zero.layout import GroupLayout, copy_ranges

if TYPE_CHECKING:
    from zcore.engine import ZEngine

FORMAT = "zstack-zero-v1"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _frozen_and_buffers(engine: ZEngine) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    trainable = {id(p) for ps in engine.zopt.params for p in ps}
    frozen = {}
    for name, p in engine.module.named_parameters():
        if id(p) in trainable:
            continue
        if engine.stage3 is not None and p in engine.stage3.params:
            engine.stage3.gather([p], "gather(frozen parameter for checkpoint)")
            frozen[name] = p.data.detach().clone()
            engine.stage3.release([p])
        else:
            frozen[name] = p.data.detach().clone()
    buffers = {n: b.detach().clone() for n, b in engine.module.named_buffers()}
    return frozen, buffers


def _aliases(engine: ZEngine) -> dict[str, str]:
    first: dict[int, str] = {}
    aliases = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def save(engine: ZEngine, save_dir: str, tag: str | None, client_state: dict, latest: bool) -> str:
    """Write the checkpoint (collective: every rank must call it)."""
    root = Path(save_dir)
    tag = tag or f"global_step{engine.global_steps}"
    if "/" in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain name (no `/`, no leading `.`)")
    tmp = root / f".tmp-{tag}"
    zopt, comm = engine.zopt, engine.comm
    failure = ""
    try:
        if engine.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    except OSError as err:
        failure = f"rank 0 could not create `{tmp}`: {err}"
    if comm.max_flag(bool(failure), "all_reduce(checkpoint dir ready)"):
        raise CheckpointError(failure or f"rank 0 could not create `{tmp}`")

    frozen, buffers = _frozen_and_buffers(engine)  # collective at stage 3
    writes_shard = zopt.shard_world > 1 or engine.rank == 0
    try:
        if writes_shard:
            shard = {
                "master": zopt.master_for_save(),
                "optimizer": zopt.optimizer_state_for_save(),
            }
            save_torch(shard, tmp / rank_file(zopt.shard_rank))
        if engine.rank == 0:
            common = {
                "frozen": frozen,
                "buffers": buffers,
                "client_state": client_state,
                "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
                "param_groups": zopt.optimizer.state_dict()["param_groups"],
            }
            save_torch(common, tmp / "common.pt")
    except Exception as err:
        failure = (
            f"rank {engine.rank} could not write its checkpoint shard under `{tmp}`: {err}; "
            f"free space or choose another save_dir (the previous checkpoint in `{root}` is intact)"
        )
    if comm.max_flag(bool(failure), "all_reduce(checkpoint shards written)"):
        if engine.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(failure or f"another rank failed to write its shard under `{tmp}`")

    if engine.rank == 0:
        try:
            save_json(_manifest(engine, tag), tmp / "manifest.json")
            final, old = root / tag, root / f".old-{tag}"
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            fsync_dir(root)
            shutil.rmtree(old, ignore_errors=True)
            if latest:
                save_text(tag, root / "latest")
        except OSError as err:
            failure = f"could not publish checkpoint `{root / tag}`: {err}"
    if comm.max_flag(bool(failure), "all_reduce(checkpoint published)"):
        raise CheckpointError(failure or "rank 0 could not publish the checkpoint")
    return str(root / tag)


def _manifest(engine: ZEngine, tag: str) -> dict[str, Any]:
    zopt = engine.zopt
    return {
        "format": FORMAT,
        "tag": tag,
        "world_size": engine.world_size,
        "shard_world": zopt.shard_world,
        "stage": engine.stage,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "optimizer": type(zopt.optimizer).__name__,
        "groups": [layout.to_json() for layout in zopt.layouts],
        "aliases": _aliases(engine),
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "loss_scaler": engine.scaler.state_dict() if engine.scaler else None,
        "config": engine.config.to_dict(),
    }


def resolve_tag(root: Path, tag: str | None) -> str:
    if tag is not None:
        return tag
    pointer = root / "latest"
    if not pointer.exists():
        raise CheckpointError(
            f"no `latest` file in `{root}`; pass tag= (one of: "
            f"{sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith('.')) if root.is_dir() else 'none, the directory does not exist'})"
        )
    return pointer.read_text().strip()


def load(
    engine: ZEngine, load_dir: str, tag: str | None, load_optimizer: bool, load_scheduler: bool
) -> tuple[str, dict]:
    """Load a checkpoint written on any world size into ``engine`` (collective)."""
    root = Path(load_dir)
    tag = resolve_tag(root, tag)
    path = root / tag
    manifest = load_json(path / "manifest.json")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"`{path}` has format {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    zopt = engine.zopt
    old_layouts = [GroupLayout.from_json(g) for g in manifest["groups"]]
    if len(old_layouts) != len(zopt.layouts):
        raise CheckpointError(
            f"`{path}` has {len(old_layouts)} parameter groups, the engine has "
            f"{len(zopt.layouts)}; build the optimizer with the same param groups"
        )
    for old, new in zip(old_layouts, zopt.layouts, strict=True):
        missing = {s.name for s in new.shards} - {s.name for s in old.shards}
        if missing:
            raise CheckpointError(
                f"`{path}` has no values for {sorted(missing)[:5]} (model changed since the save?)"
            )
    inner = zopt.optimizer
    state = inner.state_dict()
    masters = zopt.master_for_load()
    for g in range(len(masters)):
        state["state"].setdefault(g, {})
    for src_rank in range(int(manifest["shard_world"])):
        shard = load_torch(path / rank_file(src_rank))
        for g, (old, new) in enumerate(zip(old_layouts, zopt.layouts, strict=True)):
            copy_ranges(masters[g], new, zopt.shard_rank, shard["master"][g], old, src_rank)
            if not load_optimizer:
                continue
            saved = shard["optimizer"].get(g, {})
            for key, value in saved.items():
                mine = state["state"][g].get(key)
                partitioned = value.ndim == 1 and value.numel() == old.numel
                if partitioned:
                    if mine is None or mine.numel() != new.numel:
                        mine = torch.zeros(new.numel, dtype=value.dtype)
                        state["state"][g][key] = mine
                    copy_ranges(mine, new, zopt.shard_rank, value, old, src_rank)
                elif src_rank == 0:
                    state["state"][g][key] = value.clone()
    common = load_torch(path / "common.pt")
    if load_optimizer:
        state["state"] = {k: v for k, v in state["state"].items() if v}
        state["param_groups"] = [
            {**saved, "params": mine["params"]}
            for saved, mine in zip(common["param_groups"], state["param_groups"], strict=True)
        ]
    zopt.finish_load(masters, state if load_optimizer else None)
    zopt.publish()
    _load_frozen_and_buffers(engine, common)
    if load_scheduler and engine.lr_scheduler is not None and common["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(common["lr_scheduler"])
    engine.global_steps = int(manifest["global_steps"])
    engine.micro_steps = int(manifest["micro_steps"])
    engine.global_samples = int(manifest["global_samples"])
    engine.skipped_steps = int(manifest["skipped_steps"])
    engine.comm.step = engine.global_steps
    if engine.scaler is not None and manifest["loss_scaler"] is not None:
        engine.scaler.load_state_dict(manifest["loss_scaler"])
    zopt.zero_grad()
    return str(path), dict(common["client_state"])


def _load_frozen_and_buffers(engine: ZEngine, common: dict) -> None:
    params = dict(engine.module.named_parameters())
    for name, value in common["frozen"].items():
        p = params.get(name)
        if p is None:
            continue
        if engine.stage3 is not None and p in engine.stage3.params:
            engine.stage3.gather([p], "gather(frozen parameter for load)")
            p.data.copy_(value)
            engine.stage3.repartition(p)
            engine.stage3.release([p])
        else:
            p.data.copy_(value)
    buffers = dict(engine.module.named_buffers())
    for name, value in common["buffers"].items():
        if name in buffers:
            buffers[name].copy_(value)
