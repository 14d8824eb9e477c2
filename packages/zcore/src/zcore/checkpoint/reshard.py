"""Re-cutting a checkpoint's trained parameters for the layout that loads it.

A checkpoint saved at one ``(pp, tp, dp)`` layout loads directly at any other: there is no
offline conversion. What a rank file holds of a parameter is a *piece*: one ZeRO slot
(elements ``owned(slot)`` of the flattened tensor) of one tensor-parallel shard (of the
whole tensor when ``tp`` does not cut it) of the copy one pipeline stage holds. A load fills
each of this rank's *targets* — its ZeRO slot of its own ``tp`` shard of every parameter
its pipeline stage now holds, for the fp32 master and for every per-element optimizer state
(Adam's ``exp_avg``, ``exp_avg_sq``) — from those pieces, matched by parameter name:

- names are the same on every layout (a ``PipelineModule``'s ``layers.<i>.…`` whatever
  stage now holds layer ``i``, and ``tied.<key>.…``; a tensor-parallel layer keeps the name
  of the layer it replaced; a model may save under another model's names,
  :mod:`zcore.checkpoint.names`), so re-mapping layers to the new stages is reading the
  files of the stage that held them (a tied layer held by several stages is read from one;
  the manifest's parameter table, :mod:`zcore.checkpoint.table`, says which stages);
- the same ``tp`` cut (or none) at save and at load: each saved slot's element range is
  intersected with the target's, and only the overlapping elements are copied (the ZeRO
  re-cut across ``dp`` sizes);
- another ``tp`` (1 included): the saved shards that overlap this rank's new shard are
  joined into the full tensor (:meth:`TPCut.unshard`, blocks of a fused weight back in
  place) and the new shard is cut from it (:meth:`TPCut.shard`);
- per-group scalars (Adam's ``step``) and hyperparameters come from the saved group that
  holds the new group's first parameter: the groups themselves differ between layouts
  (tensor-parallel shards form groups of their own, a stage holds only its layers' groups).

Rank files are memory-mapped, so a rank reads only the bytes it copies (at another ``tp``:
the whole of each saved shard overlapping its new one). Nothing here changes the engine:
targets are new buffers, committed by :mod:`zcore.checkpoint.restore`. Frozen parameters and
buffers are saved whole per pipeline stage (``common.pt``: the first stage's; a rank file of
each later stage's first rank: that stage's, :meth:`SavedParams.stage_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zcore.checkpoint.files import CheckpointError, load_torch
from zcore.checkpoint.rank_files import file_pieces
from zcore.checkpoint.table import full_shape, saved_cuts
from zcore.tensor.cut import TPCut
from zcore.zero.layout import GroupLayout, ParamShard

MASTER = "master"
"""The key :meth:`SavedParams.fill` reads the fp32 master values by (else an optimizer
state key: ``exp_avg``, ``exp_avg_sq``)."""
DAMAGED = "the checkpoint is damaged: load another tag (or save again)"


@dataclass(frozen=True)
class Piece:
    """One ZeRO slot of one saved tensor: rank file ``file``, its group ``group``."""

    file: str
    group: int
    shard: ParamShard
    slot: int


class SavedParams:
    """Where every saved parameter's pieces are, read from rank files ``files``.

    ``stage_for(name)`` names the pipeline coordinate whose copy of ``name`` to use (None:
    the lowest that holds one). ``layouts`` are the manifest's groups (the cut of files
    written before rank files recorded their own).
    """

    def __init__(
        self,
        path: Path,
        manifest: dict[str, Any],
        files: Sequence[str],
        layouts: list[GroupLayout],
        stage_for: Callable[[str], int | None] = lambda name: None,
    ) -> None:
        self.path = path
        self.cuts = saved_cuts(manifest)
        """How each tensor-parallel parameter was cut at save."""
        self.data: dict[str, dict[str, Any]] = {}
        self.numel: dict[tuple[str, int], int] = {}
        self.pieces: dict[str, dict[int, list[Piece]]] = {}
        """Per name, per saved ``tp`` coordinate (0 when not cut), its slots."""
        self.stage: dict[str, int] = {}
        coords = manifest.get("files") or {}
        for name in files:
            shard, pieces = _open(path / name, manifest, layouts)
            self.data[name] = shard
            where = coords.get(name, {})
            pp, tp = int(where.get("pp", 0)), int(where.get("tp", 0))
            for g, piece in enumerate(pieces):
                if piece is not None:
                    self._add(name, g, piece, pp, tp, stage_for)

    def _add(
        self,
        file: str,
        g: int,
        piece: tuple[GroupLayout, int],
        pp: int,
        tp: int,
        stage_for: Callable[[str], int | None],
    ) -> None:
        layout, slot = piece
        self.numel[(file, g)] = layout.numel
        for s in layout.shards:
            want = stage_for(s.name)
            if want is not None and want != pp:
                continue
            have = self.stage.setdefault(s.name, pp)
            if pp > have:  # another stage's copy of a tied parameter
                continue
            if pp < have:
                self.pieces.pop(s.name, None)
                self.stage[s.name] = pp
            t = tp if s.name in self.cuts else 0
            self.pieces.setdefault(s.name, {}).setdefault(t, []).append(Piece(file, g, s, slot))

    # -- what the checkpoint holds ---------------------------------------------------------
    def first(self, name: str) -> Piece:
        """A piece of ``name`` (its group gives the scalars and hyperparameters)."""
        by_tp = self.pieces[name]
        return by_tp[min(by_tp)][0]

    def full_shape(self, name: str) -> tuple[int, ...]:
        return full_shape(self.first(name).shard.shape, self.cuts.get(name))

    def group_state(self, piece: Piece) -> dict[Any, Any]:
        """The optimizer state of the saved group ``piece`` belongs to."""
        return self.data[piece.file]["optimizer"].get(piece.group, {})

    def hyper(self, piece: Piece, common: list[dict[str, Any]]) -> dict[str, Any]:
        """The saved hyperparameters of the group ``piece`` belongs to (the rank file's own;
        files written before they kept them: ``common.pt``'s group of that index)."""
        own = self.data[piece.file].get("param_groups")
        groups = own if isinstance(own, list) else common
        if piece.group >= len(groups):
            raise CheckpointError(
                f"`{self.path / piece.file}` holds parameter group {piece.group} but the "
                f"checkpoint lists {len(groups)} optimizer param groups; {DAMAGED}"
            )
        return groups[piece.group]

    def values(self, piece: Piece, key: str) -> torch.Tensor:
        """The flat saved tensor (``key``: master or a state) ``piece``'s slot sits in."""
        shard = self.data[piece.file]
        if key == MASTER:
            v = shard["master"][piece.group]
        else:
            v = shard["optimizer"].get(piece.group, {}).get(key)
        want = self.numel[(piece.file, piece.group)]
        if not torch.is_tensor(v) or v.ndim != 1 or v.numel() != want:
            got = list(v.shape) if torch.is_tensor(v) else type(v).__name__
            raise CheckpointError(
                f"`{self.path / piece.file}` holds {key} values of shape {got} for parameter "
                f"group {piece.group}, its layout says [{want}]; {DAMAGED}"
            )
        return v

    def stage_model(self) -> dict[str, dict[str, torch.Tensor]]:
        """The frozen parameters and buffers the rank files read keep for their pipeline
        stages after the first (``common.pt`` holds the first stage's)."""
        out: dict[str, dict[str, torch.Tensor]] = {"frozen": {}, "buffers": {}}
        for shard in self.data.values():
            model = shard.get("model")
            if isinstance(model, dict):
                for kind in out:
                    out[kind].update(model.get(kind) or {})
        return out

    # -- filling targets -----------------------------------------------------------------
    def fill(
        self,
        dst: torch.Tensor,
        d: ParamShard,
        rank: int,
        key: str,
        cut: TPCut | None,
        coord: int,
    ) -> int:
        """Copy slot ``rank`` of ``d`` (this rank's ``tp`` shard at ``coord``, cut as
        ``cut``; None: the whole tensor) into ``dst`` at ``d.offset``; returns how many
        elements were copied."""
        d0, d1 = d.owned(rank)
        if d0 >= d1:
            return 0
        old = self.cuts.get(d.name)
        out = dst[d.offset : d.offset + d1 - d0]
        if old == cut:
            return self._ranges(out, d0, d1, self.pieces[d.name].get(coord if cut else 0), key)
        full = self.full_tensor(d.name, key, _overlapping(old, cut, coord))
        local = cut.shard(full, coord) if cut is not None else full
        out.copy_(local.reshape(-1)[d0:d1])
        return d1 - d0

    def _ranges(
        self, out: torch.Tensor, d0: int, d1: int, pieces: list[Piece] | None, key: str
    ) -> int:
        copied = 0
        for p in pieces or ():
            s0, s1 = p.shard.owned(p.slot)
            lo, hi = max(d0, s0), min(d1, s1)
            if lo < hi:
                src = self.values(p, key)
                at = p.shard.offset
                out[lo - d0 : hi - d0].copy_(src[at + lo - s0 : at + hi - s0])
                copied += hi - lo
        return copied

    def full_tensor(self, name: str, key: str, keep: set[int] | None = None) -> torch.Tensor:
        """The saved full tensor of ``name`` (a copy; the tensor-parallel shards outside
        ``keep`` left zero)."""
        cut = self.cuts.get(name)
        by_tp = self.pieces[name]
        shards = []
        for t in range(cut.tp if cut is not None else 1):
            pieces = by_tp.get(t)
            if not pieces:
                raise CheckpointError(
                    f"no rank file of `{self.path}` holds tp shard {t} of `{name}`; {DAMAGED}"
                )
            shape = pieces[0].shard.shape
            if keep is not None and t not in keep:
                shards.append(torch.zeros(shape, dtype=self.values(pieces[0], key).dtype))
                continue
            s = pieces[0].shard
            flat = torch.zeros(s.numel, dtype=self.values(pieces[0], key).dtype)
            if self._ranges(flat, 0, s.numel, pieces, key) != s.numel:
                raise CheckpointError(
                    f"the rank files of `{self.path}` do not hold every element of tp shard "
                    f"{t} of `{name}` ({s.numel} elements); {DAMAGED}"
                )
            shards.append(flat.view(shape))
        return cut.unshard(shards) if cut is not None else shards[0]

    def group_state_for(
        self, new: GroupLayout, rank: int, cuts: dict[str, TPCut], coord: int
    ) -> dict[str, Any]:
        """The optimizer state of a new group: its per-element states re-cut like the
        master, its scalars from the saved group holding its first parameter."""
        if not new.shards:
            return {}
        src = self.first(new.shards[0].name)
        out: dict[str, Any] = {}
        for key, value in self.group_state(src).items():
            flat = torch.is_tensor(value) and value.ndim == 1
            if flat and value.numel() == self.numel[(src.file, src.group)]:
                buf = torch.zeros(new.numel, dtype=value.dtype)
                for d in new.shards:
                    self.fill(buf, d, rank, key, cuts.get(d.name), coord)
                out[key] = buf
            else:
                out[key] = value.clone() if torch.is_tensor(value) else value
        return out


def _overlapping(old: TPCut | None, new: TPCut | None, coord: int) -> set[int] | None:
    """The saved ``tp`` shards that hold part of new shard ``coord`` (None: all of them)."""
    if old is None or new is None or old.dim != new.dim or old.blocks != new.blocks:
        return None
    keep = set()
    for b in range(len(old.blocks)):
        lo, hi = coord * new.local(b), (coord + 1) * new.local(b)
        keep |= {t for t in range(old.tp) if t * old.local(b) < hi and lo < (t + 1) * old.local(b)}
    return keep


def _open(
    file: Path, manifest: dict[str, Any], layouts: list[GroupLayout]
) -> tuple[dict[str, Any], list[tuple[GroupLayout, int] | None]]:
    """A rank file and what it holds of each group, checked to be one."""
    shard = load_torch(file)
    master = shard.get("master") if isinstance(shard, dict) else None
    state = shard.get("optimizer") if isinstance(shard, dict) else None
    pieces = None
    if isinstance(master, list | tuple) and isinstance(state, dict):
        try:
            pieces = file_pieces(manifest, file.name, shard, layouts)
        except (KeyError, TypeError, ValueError):
            pieces = None
    if pieces is None or len(pieces) != len(master):  # type: ignore[arg-type]
        raise CheckpointError(
            f"`{file}` is not a rank file of this checkpoint (expected master values and "
            f"optimizer state for each parameter group); {DAMAGED}"
        )
    return shard, pieces
