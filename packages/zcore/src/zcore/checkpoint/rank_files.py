"""Which rank files a checkpoint has, and which slot of which group each one holds.

A rank file holds, for every parameter group it owns, this rank's master partition and
optimizer state, with the group's layout and the rank's slot in it (``"groups"``). Dense
groups are owned by the first replica of each ``dp`` slot; expert groups by every rank of
each ``(ep, edp)`` coordinate, whose layouts name different experts. Files written before
per-group axes carry no ``"groups"``: every group is cut as the manifest says and the file
holds the slot of its ``dp`` coordinate.
"""

from __future__ import annotations

from typing import Any

from zcore.checkpoint.sharded import rank_file
from zcore.zero.layout import GroupLayout

Piece = tuple[GroupLayout, int]
"""A group's layout in a rank file and the slot of it the file holds."""


def listed_files(manifest: dict[str, Any]) -> list[str]:
    """The rank files ``manifest`` says its checkpoint has."""
    files = manifest.get("files")
    if isinstance(files, dict) and files:
        return sorted(files)
    return [rank_file(r) for r in range(int(manifest["shard_world"]))]


def file_pieces(
    manifest: dict[str, Any], name: str, shard: dict[str, Any], layouts: list[GroupLayout]
) -> list[Piece | None]:
    """Per group, what rank file ``name`` (loaded as ``shard``) holds of it (None: nothing)."""
    info = shard.get("groups")
    if info is None:
        files = manifest.get("files") or {}
        slot = int(files[name]["dp"]) if name in files else int(name[len("rank_") : -len(".pt")])
        return [(layout, slot) for layout in layouts]
    return [
        None if i is None else (GroupLayout.from_json(i["layout"]), int(i["rank"])) for i in info
    ]
