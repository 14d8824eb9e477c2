"""The manifest's parameter table: every trained parameter's full shape, cut and stages.

``manifest["params"]`` maps each trained parameter's name (the same on every layout: a
``PipelineModule``'s ``layers.<i>.…`` and ``tied.<key>.…``, a tensor-parallel layer's the
name of the layer it replaced) to::

    {"shape": [full shape], "stages": [pipeline coordinates holding a copy],
     "tp": {"dim": d, "blocks": [...], "tp": t}}     # "tp" only when tensor parallelism cuts it

It is built at save from every rank's optimizer groups (collective). A load reads it to
check the model's names and full shapes before touching a rank file, to pick which pipeline
stage's files hold each parameter it now owns, and to re-cut tensor-parallel shards
(:mod:`zcore.checkpoint.reshard`). Checkpoints written before the table load without it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from zcore.comm import Comm
from zcore.tensor.cut import TPCut, cut_from_json
from zcore.zero.layout import GroupLayout

Table = dict[str, dict[str, Any]]


def full_shape(local: Sequence[int], cut: TPCut | None) -> tuple[int, ...]:
    """The full shape of a tensor whose tensor-parallel shard has shape ``local``."""
    shape = list(local)
    if cut is not None:
        shape[cut.dim] = sum(cut.blocks)
    return tuple(shape)


def local_table(layouts: Sequence[GroupLayout], cuts: dict[str, Any], stage: int) -> Table:
    """This rank's rows: the parameters of its groups (``cuts``: its ``tp_cuts`` JSON)."""
    out: Table = {}
    for layout in layouts:
        for s in layout.shards:
            info = cuts.get(s.name)
            cut = cut_from_json(info) if info is not None else None
            row: dict[str, Any] = {"shape": list(full_shape(s.shape, cut)), "stages": [stage]}
            if cut is not None:
                row["tp"] = {"dim": cut.dim, "blocks": list(cut.blocks), "tp": cut.tp}
            out[s.name] = row
    return out


def merge(tables: Sequence[Table]) -> Table:
    """One table from every rank's rows (stages united; the rest is the same everywhere)."""
    out: Table = {}
    for table in tables:
        for name, row in table.items():
            have = out.get(name)
            if have is None:
                out[name] = {**row, "stages": list(row["stages"])}
            else:
                have["stages"] = sorted(set(have["stages"]) | set(row["stages"]))
    return out


def all_gather_json(comm: Comm, obj: Any, what: str) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in rank order (collective over ``comm``)."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = torch.empty(comm.size, dtype=torch.int64)
    comm.all_gather(sizes, torch.tensor([data.numel()]), f"all_gather({what} sizes)").wait()
    width = int(sizes.max())
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = torch.empty(comm.size * width, dtype=torch.uint8)
    comm.all_gather(out, padded, f"all_gather({what})").wait()
    rows = out.view(comm.size, width)
    return [json.loads(bytes(rows[r, : int(sizes[r])].tolist())) for r in range(comm.size)]


def saved_cuts(manifest: dict[str, Any]) -> dict[str, TPCut]:
    """How the checkpoint's tensor-parallel shards are cut, by parameter name: from the
    table, else (older checkpoints) the manifest's ``tp_cuts``."""
    table = manifest.get("params")
    if isinstance(table, dict):
        return {n: cut_from_json(r["tp"]) for n, r in table.items() if r.get("tp")}
    return {n: cut_from_json(c) for n, c in (manifest.get("tp_cuts") or {}).items()}
