"""Load a sharded checkpoint into an engine: read and check everything, then commit.

A checkpoint loads at any ``(pp, tp, dp)`` layout, whatever layout saved it: each rank
reads the pieces of the parameters its pipeline stage now holds and re-cuts them for its
``tp`` shard and ZeRO slot (:mod:`zcore.checkpoint.reshard`); the counters, the LR
scheduler and the loss scaler are saved whole and load unchanged; per-rank error feedback
loads only on the same mesh (:mod:`zcore.checkpoint.rank_state`).

The engine changes only after every rank has read every file into new buffers and checked
them against the engine: parameter names and full shapes, the optimizer's kind, the files'
contents. A problem on any rank raises :class:`CheckpointError` on every rank with the
engine (master weights, optimizer state, model, counters) exactly as it was, so training
can go on after catching it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zcore.checkpoint.files import CheckpointError, load_json, load_torch
from zcore.checkpoint.names import Names
from zcore.checkpoint.rank_files import listed_files
from zcore.checkpoint.rank_state import read_rank_state
from zcore.checkpoint.reshard import MASTER, SavedParams
from zcore.checkpoint.sharded import FORMAT, resolve_tag
from zcore.checkpoint.table import full_shape
from zcore.tensor.cut import TPCut, cut_from_json
from zcore.zero.layout import GroupLayout

if TYPE_CHECKING:
    from zcore.checkpoint.parts import CheckpointParts

#: Optimizer classes whose per-parameter states have the same keys, by that kind of state
#: (zcore's CPU optimizers load torch.optim's state and the other way round).
_STATE_KIND = {
    "Adam": "Adam",
    "AdamW": "Adam",
    "CPUAdam": "Adam",
    "CPUAdamW": "Adam",
    "FusedAdam": "Adam",
    "Adagrad": "Adagrad",
    "CPUAdagrad": "Adagrad",
    "Lion": "Lion",
    "CPULion": "Lion",
}
_COMMON_KEYS = ("frozen", "buffers", "client_state", "lr_scheduler", "param_groups")
_DAMAGED = "the checkpoint is damaged: load another tag (or save again)"


@dataclass
class _Loaded:
    """Everything a load commits, read and checked while the engine is untouched."""

    path: Path
    targets: list[torch.Tensor]  # sharded.load_targets(): what its load_state_dict receives
    masters: list[torch.Tensor]  # the checkpoint's values for them (maybe the same tensors)
    state: dict[str, Any] | None  # the inner optimizer's new state_dict
    common: dict[str, Any]
    counters: dict[str, int]
    loss_scaler: dict[str, Any] | None
    rank_state: dict[str, Any] | None = None  # this rank's error feedback (:mod:`.rank_state`)


def load(
    parts: CheckpointParts,
    load_dir: str,
    tag: str | None,
    load_optimizer: bool,
    load_scheduler: bool,
) -> tuple[str, dict]:
    """Load a checkpoint written at any layout (pipeline stages, tensor-parallel size,
    data-parallel size) into ``parts`` (collective).

    Raises :class:`CheckpointError` on every rank, leaving the parts unchanged, when any
    rank cannot read a file or finds that the checkpoint does not fit them.
    """
    root = Path(load_dir)
    loaded: _Loaded | None = None
    failure: Exception | None = None
    try:
        loaded = _read(parts, root, tag, load_optimizer)
    except Exception as err:  # every rank must reach the vote below
        failure = err
    if parts.place.comm.max_flag(failure is not None, "all_reduce(checkpoint read and checked)"):
        unchanged = "nothing was loaded, the engine is unchanged"
        if failure is None:
            raise CheckpointError(
                f"another rank could not read or check the checkpoint in `{root}` (its error "
                f"names the file and the fix); {unchanged}"
            )
        what = "" if isinstance(failure, CheckpointError) else f"{type(failure).__name__}: "
        raise CheckpointError(f"{what}{failure}; {unchanged}") from failure
    assert loaded is not None
    _commit(parts, loaded, load_scheduler)
    return str(loaded.path), dict(loaded.common["client_state"])


def _read(parts: CheckpointParts, root: Path, tag: str | None, load_optimizer: bool) -> _Loaded:
    """Read and check every file into new buffers; changes nothing in ``parts``."""
    path = root / resolve_tag(root, tag)
    manifest = load_json(path / "manifest.json")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"`{path}` has format {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    try:
        old_layouts = [GroupLayout.from_json(g) for g in manifest["groups"]]
        counters = {k: int(manifest[k]) for k in parts.counters.state_dict()}
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"`{path / 'manifest.json'}` lacks or mangles {err}; {_DAMAGED}"
        ) from err
    sharded = parts.sharded
    if load_optimizer:
        _check_optimizer(path, manifest.get("optimizer"), sharded.kind)
    names = Names(parts.model.checkpoint_names())
    layouts = names.layouts(sharded.layouts)  # this rank's targets, by their saved names
    wanted = [s.name for layout in layouts for s in layout.shards]
    # parameters the model freezes that the checkpoint trained: from its master weights
    table = manifest.get("params") if isinstance(manifest.get("params"), dict) else {}
    shapes, trained = parts.model.shapes()[0], set(wanted)
    thaw = [n for n in shapes if names.saved(n) in table and names.saved(n) not in trained]
    files, stage_for = choose_files(manifest, parts.place, wanted + [names.saved(n) for n in thaw])
    saved = SavedParams(path, manifest, files, old_layouts, stage_for)
    cuts = {names.saved(n): cut_from_json(c) for n, c in (parts.info.get("tp_cuts") or {}).items()}
    _check_fit(path, saved, layouts, cuts)

    coord = int(parts.place.coords.get("tp", 0))
    targets = sharded.load_targets()
    masters = [_buffer_for(t, sharded.live()) for t in targets]
    for g, new in enumerate(layouts):
        rank = sharded.group_rank(g)
        copied = sum(
            saved.fill(masters[g], d, rank, MASTER, cuts.get(d.name), coord) for d in new.shards
        )
        want = sum(hi - lo for lo, hi in (d.owned(rank) for d in new.shards))
        if copied != want:
            raise CheckpointError(
                f"the rank files of `{path}` hold {copied} of the {want} values this rank "
                f"needs in parameter group {g}; {_DAMAGED}"
            )
    common = load_torch(path / "common.pt")
    if isinstance(common, dict) and isinstance(common.get("frozen"), dict):
        stages = saved.stage_model()  # later pipeline stages' frozen parameters and buffers
        common = {
            **common,
            **{
                k: names.keys({**stages[k], **(common.get(k) or {})}, to_model=True) for k in stages
            },
        }
    _check_common(path / "common.pt", common, parts, len(old_layouts))
    if thaw:
        frozen = _thawed(path, saved, names, shapes, thaw, cuts, coord)
        common = {**common, "frozen": {**frozen, **common["frozen"]}}

    state = None
    if load_optimizer:
        states = [
            saved.group_state_for(new, sharded.group_rank(g), cuts, coord)
            for g, new in enumerate(layouts)
        ]
        state = {
            "state": {g: s for g, s in enumerate(states) if s},
            "param_groups": [
                {**_saved_hyper(saved, new, g, common, mine), "params": mine["params"]}
                for g, (new, mine) in enumerate(zip(layouts, sharded.param_groups(), strict=True))
            ],
        }
    per_rank = read_rank_state(parts.place, path, manifest) if load_optimizer else None
    return _Loaded(
        path, targets, masters, state, common, counters, manifest.get("loss_scaler"), per_rank
    )


def choose_files(
    manifest: dict[str, Any], place: Any, names: list[str]
) -> tuple[list[str], Callable[[str], int | None]]:
    """The rank files this rank reads, and which pipeline stage's copy of each parameter
    it takes: its own stage's when the checkpoint has the same number of stages, else the
    lowest stage holding one (a tied layer is held by several)."""
    files = listed_files(manifest)
    info = manifest.get("files") or {}
    saved_pp = int((manifest.get("mesh") or {}).get("pp", 1))
    same = saved_pp == int(place.mesh.get("pp", 1))
    mine = int(place.coords.get("pp", 0))
    table = manifest.get("params")

    def stage_of(file: str) -> int:
        return int(info.get(file, {}).get("pp", 0))

    if isinstance(table, dict):

        def stage_for(name: str) -> int | None:
            row = table.get(name)
            if row is None:
                return None
            stages = [int(s) for s in row.get("stages", [0])]
            return mine if same and mine in stages else min(stages)

        wanted = {stage_for(n) for n in names}
        if None in wanted:  # a name the checkpoint lacks: read every file to say so
            return files, stage_for
        return [f for f in files if stage_of(f) in wanted], stage_for
    if saved_pp > 1 and same:  # written before the table: this stage's files
        return [f for f in files if stage_of(f) == mine], lambda name: mine
    return files, lambda name: None


def _saved_hyper(
    saved: SavedParams, new: GroupLayout, g: int, common: dict[str, Any], mine: dict[str, Any]
) -> dict[str, Any]:
    """A new group's saved hyperparameters: those of the saved group holding its first
    parameter (an empty group: the saved group of its index, else its own)."""
    if new.shards:
        return saved.hyper(saved.first(new.shards[0].name), common["param_groups"])
    groups = common["param_groups"]
    return groups[g] if g < len(groups) else {k: v for k, v in mine.items() if k != "params"}


def _buffer_for(target: torch.Tensor, live: list[torch.Tensor]) -> torch.Tensor:
    """Where the loaded master values of ``target`` go until the commit: a new CPU tensor
    when ``target`` is the live master, ``target`` itself when it is already a new one."""
    ptr = target.untyped_storage().data_ptr()
    if target.numel() and any(m.numel() and m.untyped_storage().data_ptr() == ptr for m in live):
        return torch.zeros(target.shape, dtype=target.dtype)
    return target


def _thawed(
    path: Path,
    saved: SavedParams,
    names: Names,
    shapes: dict[str, tuple[int, ...]],
    thaw: list[str],
    cuts: dict[str, TPCut],
    coord: int,
) -> dict[str, torch.Tensor]:
    """The values of the parameters the model freezes but the checkpoint trained (this
    rank's ``tp`` shard of each, whole over ``dp``), by the model's names."""
    out = {}
    for name in thaw:
        key = names.saved(name)
        cut = cuts.get(key)
        if saved.full_shape(key) != full_shape(shapes[name], cut):
            _raise_shapes(
                path, "parameter", [(key, saved.full_shape(key), full_shape(shapes[name], cut))]
            )
        full = saved.full_tensor(key, MASTER)
        out[name] = cut.shard(full, coord) if cut is not None else full
    return out


def _check_fit(
    path: Path, saved: SavedParams, layouts: list[GroupLayout], cuts: dict[str, TPCut]
) -> None:
    """Every trainable parameter of the engine is in the checkpoint with the same full
    shape (tensor-parallel shards compared as the tensors they are cut from)."""
    wanted = [d for layout in layouts for d in layout.shards]
    missing = [d.name for d in wanted if d.name not in saved.pieces]
    if missing:
        held = sorted(saved.pieces)
        raise CheckpointError(
            f"`{path}` has no values for {len(missing)} of the model's parameters, "
            f"{missing[:5]} (it holds {len(held)}, e.g. {held[:3]}): the model changed since "
            "the save? Load it into the model it was saved from (same layers and names; "
            "any pp/tp/dp layout), or pass it through `z checkpoint consolidate` and adapt "
            "the names yourself"
        )
    changed = [
        (d.name, saved.full_shape(d.name), full_shape(d.shape, cuts.get(d.name)))
        for d in wanted
        if saved.full_shape(d.name) != full_shape(d.shape, cuts.get(d.name))
    ]
    if changed:
        _raise_shapes(path, "parameter", changed)


def _raise_shapes(path: Path, kind: str, changed: list[tuple[str, Any, Any]]) -> None:
    listing = "; ".join(
        f"{kind} `{name}` was saved with shape {list(saved)}, the model's is {list(now)}"
        for name, saved, now in changed[:5]
    )
    more = f" (and {len(changed) - 5} more)" if len(changed) > 5 else ""
    raise CheckpointError(
        f"`{path}` does not fit the model: {listing}{more}. Build the model with the shapes "
        "it was saved with (same vocabulary size, widths, layers), or turn the checkpoint "
        "into a plain state_dict (`z checkpoint consolidate`, zcore.checkpoint.consolidate) "
        "and adapt those tensors yourself"
    )


def _check_optimizer(path: Path, saved: str | None, current: str) -> None:
    """The checkpoint's optimizer state is of the kind the engine's optimizer steps with."""
    if saved is None or _STATE_KIND.get(saved, saved) == _STATE_KIND.get(current, current):
        return
    raise CheckpointError(
        f"`{path}` holds the state of a {saved} optimizer, but this engine's optimizer is "
        f"{current}: their states differ, so {current} cannot resume from it. Build the "
        f"engine with the optimizer the checkpoint was saved with (config `optimizer.type`), "
        f"or pass load_optimizer_states=False to load the weights only and start {current} "
        "afresh"
    )


def _check_common(file: Path, common: Any, parts: CheckpointParts, groups: int) -> None:
    """``common.pt`` is whole and its frozen parameters and buffers fit the model."""
    if not isinstance(common, dict) or any(k not in common for k in _COMMON_KEYS):
        raise CheckpointError(
            f"`{file}` is not the common file of this checkpoint (expected the keys "
            f"{list(_COMMON_KEYS)}); {_DAMAGED}"
        )
    if len(common["param_groups"]) != groups:
        raise CheckpointError(
            f"`{file}` has {len(common['param_groups'])} optimizer param groups, the manifest "
            f"{groups}; {_DAMAGED}"
        )
    params, buffers = parts.model.shapes()
    changed = [
        (name, value.shape, params[name])
        for name, value in common["frozen"].items()
        if name in params and tuple(value.shape) != params[name]
    ]
    if changed:
        _raise_shapes(file.parent, "frozen parameter", changed)
    changed = [
        (name, value.shape, buffers[name])
        for name, value in common["buffers"].items()
        if name in buffers and tuple(value.shape) != buffers[name]
    ]
    if changed:
        _raise_shapes(file.parent, "buffer", changed)


def _commit(parts: CheckpointParts, loaded: _Loaded, load_scheduler: bool) -> None:
    """Move the checked values into the parts."""
    for target, values in zip(loaded.targets, loaded.masters, strict=True):
        if values is not target:
            target.copy_(values)
    parts.sharded.load_state_dict({"master": loaded.targets, "optimizer": loaded.state})
    parts.per_rank.load_state_dict(loaded.rank_state)  # may move this rank's master (0/1 Adam)
    parts.sharded.after_load()  # publishes the master into the model
    common = loaded.common
    parts.model.load_state_dict({"frozen": common["frozen"], "buffers": common["buffers"]})
    scheduler = parts.whole.get("lr_scheduler")
    if load_scheduler and scheduler is not None and common["lr_scheduler"] is not None:
        scheduler.load_state_dict(common["lr_scheduler"])
    parts.counters.load_state_dict(loaded.counters)
    scaler = parts.whole.get("loss_scaler")
    if scaler is not None and loaded.loss_scaler is not None:
        scaler.load_state_dict(loaded.loss_scaler)
