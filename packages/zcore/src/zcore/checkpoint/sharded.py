"""Save an engine's state as one file per rank plus a manifest (loading: :mod:`.restore`).

A rank file holds, for each parameter group this rank writes, its fp32 master slot and
optimizer-state slots, the group's layout and slot (``"groups"``) and the inner
optimizer's hyperparameters (``"param_groups"``). The manifest records the mesh, every
rank file's full mesh coordinates (``"files"``) and every trained parameter's full shape,
tensor-parallel cut and pipeline stages (``"params"``, :mod:`.table`): what a load at
another layout needs to re-cut (:mod:`.reshard`).
"""

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
from zcore.checkpoint.names import Names
from zcore.checkpoint.rank_state import save_rank_state
from zcore.checkpoint.table import Table, all_gather_json, local_table, merge

if TYPE_CHECKING:
    from zcore.checkpoint.parts import CheckpointParts, ShardedPart
    from zcore.zero.layout import GroupLayout

FORMAT = "zstack-zero-v1"


def rank_file(rank: int) -> str:
    """The rank file of global rank ``rank`` (the manifest's ``files`` gives its coordinates)."""
    return f"rank_{rank:05d}.pt"


def save(
    parts: CheckpointParts, save_dir: str, tag: str | None, client_state: dict, latest: bool
) -> str:
    """Write the checkpoint (collective: every rank must call it)."""
    root = Path(save_dir)
    counters = parts.counters.state_dict()
    tag = tag or f"global_step{counters['global_steps']}"
    if "/" in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain name (no `/`, no leading `.`)")
    tmp = root / f".tmp-{tag}"
    # votes span every rank of the job; replicas of a partition (MiCS) write it once
    place, sharded = parts.place, parts.sharded
    comm = place.comm
    failure = ""
    try:
        if place.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    except OSError as err:
        failure = f"rank 0 could not create `{tmp}`: {err}"
    if comm.max_flag(bool(failure), "all_reduce(checkpoint dir ready)"):
        raise CheckpointError(failure or f"rank 0 could not create `{tmp}`")

    names = Names(parts.model.checkpoint_names())
    layouts = names.layouts(sharded.layouts)
    model = {k: names.keys(v) for k, v in parts.model.state_dict().items()}  # collective (3)
    owned = [sharded.owns(g) for g in range(len(sharded.layouts))]
    files = _written_files(parts, any(owned))  # collective
    table = _param_table(parts, layouts, names)  # collective
    mine = parts.per_rank.state_dict()
    try:
        save_rank_state(place.rank, mine, tmp)
        if any(owned):
            state = sharded.state_dict()
            master, opt = state["master"], state["optimizer"]
            shard = {
                "master": [m if own else m[:0] for m, own in zip(master, owned, strict=True)],
                "optimizer": {g: s for g, s in opt.items() if owned[g]},
                "groups": [
                    _piece(sharded, layouts, g) if own else None for g, own in enumerate(owned)
                ],
                "param_groups": sharded.param_groups(),
            }
            if _stage_writer(parts) and (model["frozen"] or model["buffers"]):
                shard["model"] = model  # this pipeline stage's (common.pt holds stage 0's)
            save_torch(shard, tmp / rank_file(place.rank))
        if place.rank == 0:
            scheduler = parts.whole.get("lr_scheduler")
            common = {
                "frozen": model["frozen"],
                "buffers": model["buffers"],
                "client_state": client_state,
                "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
                "param_groups": sharded.param_groups(),
            }
            save_torch(common, tmp / "common.pt")
    except Exception as err:
        failure = (
            f"rank {place.rank} could not write its checkpoint shard under `{tmp}`: {err}; "
            f"free space or choose another save_dir (the previous checkpoint in `{root}` is intact)"
        )
    if comm.max_flag(bool(failure), "all_reduce(checkpoint shards written)"):
        if place.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(failure or f"another rank failed to write its shard under `{tmp}`")

    if place.rank == 0:
        try:
            manifest = _manifest(parts, tag, files, counters, table, layouts, names)
            if mine is not None:  # every rank wrote one (the engine's kind decides, not data)
                manifest["comm_state_world"] = place.world
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


def _stage_writer(parts: CheckpointParts) -> bool:
    """Whether this rank writes its pipeline stage's frozen parameters and buffers into its
    rank file: the first rank of every stage but the first (rank 0 writes ``common.pt``)."""
    coords = parts.place.coords
    return coords.get("pp", 0) > 0 and all(v == 0 for a, v in coords.items() if a != "pp")


def _piece(sharded: ShardedPart, layouts: list[GroupLayout], g: int) -> dict[str, Any]:
    """What a rank file says of its slot of group ``g`` (:mod:`.rank_files` reads it)."""
    return {
        "layout": layouts[g].to_json(),
        "rank": sharded.group_rank(g),
        "axis": sharded.axes[g],
    }


def _written_files(parts: CheckpointParts, writes: bool) -> dict[str, dict[str, int]]:
    """Every rank file of this save and the full mesh coordinates of the rank that wrote it
    (collective): ranks at different pipeline or tensor coordinates write different files."""
    place = parts.place
    axes = sorted(place.coords)
    mine = [place.rank if writes else -1, *(place.coords[a] for a in axes)]
    inp = torch.tensor(mine, dtype=torch.int64)
    out = torch.empty(place.comm.size * len(mine), dtype=torch.int64)
    place.comm.all_gather(out, inp, "all_gather(checkpoint rank files)").wait()
    files = {}
    for row in out.view(-1, len(mine)).tolist():
        if row[0] >= 0:
            files[rank_file(row[0])] = dict(zip(axes, row[1:], strict=True))
    return files


def _param_table(parts: CheckpointParts, layouts: list[GroupLayout], names: Names) -> Table:
    """Every trained parameter of the job: full shape, tp cut, stages (collective)."""
    place = parts.place
    mine = local_table(
        layouts, names.keys(parts.info.get("tp_cuts") or {}), place.coords.get("pp", 0)
    )
    return merge(all_gather_json(place.comm, mine, "checkpoint parameter table"))


def _manifest(
    parts: CheckpointParts,
    tag: str,
    files: dict[str, dict[str, int]],
    counters: dict[str, int],
    table: Table,
    layouts: list[GroupLayout],
    names: Names,
) -> dict[str, Any]:
    sharded, scaler = parts.sharded, parts.whole.get("loss_scaler")
    cuts = {n: r["tp"] for n, r in table.items() if r.get("tp")}
    return {
        "format": FORMAT,
        "tag": tag,
        "world_size": parts.place.data_world,
        "shard_world": sharded.shard_world,
        # the job's mesh, and where each rank file sits on it
        "mesh": parts.place.mesh,
        "files": files,
        "axes": sharded.axes,
        "stage": parts.info.get("stage"),
        "dtype": parts.info.get("dtype"),
        "optimizer": sharded.kind,
        "groups": [layout.to_json() for layout in layouts],
        "aliases": {names.saved(k): names.saved(v) for k, v in parts.model.aliases().items()},
        **counters,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "config": parts.info.get("config"),
        # every trained parameter: full shape, tp cut, pipeline stages (:mod:`.table`)
        "params": table,
        # how each tensor-parallel shard makes its full tensor (absent: nothing cut by tp)
        **({"tp_cuts": cuts} if cuts else {}),
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
