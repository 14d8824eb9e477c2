"""Save an engine's state as one file per rank plus a manifest (loading: :mod:`.restore`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zcore.checkpoint.files import (
    CheckpointError,
    fsync_dir,
    save_json,
    save_text,
    save_torch,
)
from zcore.checkpoint.rank_state import rank_state, save_rank_state

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
    # the module's state_dict keys: non-persistent buffers (rotary caches, zmoe's idle
    # expert bias) are rebuilt by the model, and DeepSpeed does not save them either
    persistent = set(engine.module.state_dict(keep_vars=True))
    buffers = {n: b.detach().clone() for n, b in engine.module.named_buffers() if n in persistent}
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
    # votes span every rank of the job; replicas of a partition (MiCS) write it once
    zopt, comm = engine.zopt, engine.world_comm
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
    parts = engine.state_parts()
    owned = [zopt.owns_group(g) for g in range(len(zopt.layouts))]
    files = _written_files(engine, any(owned))  # collective
    mine = rank_state(engine)
    try:
        save_rank_state(engine, mine, tmp)
        if any(owned):
            master, state = zopt.master_for_save(), zopt.optimizer_state_for_save()
            shard = {
                "master": [m if own else m[:0] for m, own in zip(master, owned, strict=True)],
                "optimizer": {g: s for g, s in state.items() if owned[g]},
                "groups": [_piece(zopt, g) if own else None for g, own in enumerate(owned)],
            }
            save_torch(shard, tmp / rank_file(engine.data_rank))
        if engine.rank == 0:
            common = {
                "frozen": frozen,
                "buffers": buffers,
                "client_state": client_state,
                "lr_scheduler": parts["lr_scheduler"].state_dict()
                if "lr_scheduler" in parts
                else None,
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
            manifest = _manifest(engine, tag, files)
            if mine is not None:  # every rank wrote one (the engine's kind decides, not data)
                manifest["comm_state_world"] = engine.mesh.spec.world
            save_json(manifest, tmp / "manifest.json")
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


def _piece(zopt: Any, g: int) -> dict[str, Any]:
    """What a rank file says of its slot of group ``g`` (:mod:`.rank_files` reads it)."""
    return {
        "layout": zopt.layouts[g].to_json(),
        "rank": zopt.group_rank(g),
        "axis": zopt.group_axis[g],
    }


def _written_files(engine: ZEngine, writes: bool) -> dict[str, dict[str, int]]:
    """Every rank file of this save and its coordinates on the mesh (collective)."""
    mesh = engine.mesh
    axes = ("dp", "ep", "edp") if mesh.spec.ep > 1 else ("dp",)
    mine = [engine.data_rank if writes else -1, *(mesh.coordinate(a) for a in axes)]
    inp = torch.tensor(mine, dtype=torch.int64)
    out = torch.empty(engine.world_comm.size * len(mine), dtype=torch.int64)
    engine.world_comm.all_gather(out, inp, "all_gather(checkpoint rank files)").wait()
    files = {}
    for row in out.view(-1, len(mine)).tolist():
        if row[0] >= 0:
            files[rank_file(row[0])] = dict(zip(axes, row[1:], strict=True))
    return files


def _manifest(engine: ZEngine, tag: str, files: dict[str, dict[str, int]]) -> dict[str, Any]:
    zopt, parts = engine.zopt, engine.state_parts()
    return {
        "format": FORMAT,
        "tag": tag,
        "world_size": engine.world_size,
        "shard_world": zopt.shard_world,
        # the job's mesh, and where each rank file sits on it
        "mesh": engine.mesh.describe(),
        "files": files,
        "axes": zopt.group_axis,
        "stage": engine.stage,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "optimizer": type(zopt.optimizer).__name__,
        "groups": [layout.to_json() for layout in zopt.layouts],
        "aliases": _aliases(engine),
        **engine.counters_state_dict(),
        "loss_scaler": parts["loss_scaler"].state_dict() if "loss_scaler" in parts else None,
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
