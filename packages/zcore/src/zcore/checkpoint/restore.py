"""Load a sharded checkpoint into an engine: read and check everything, then commit.

The engine changes only after every rank has read every file into new buffers and checked
them against the engine: parameter names and shapes, the optimizer's kind, the files'
contents. A problem on any rank raises :class:`CheckpointError` on every rank with the
engine (master weights, optimizer state, model, counters) exactly as it was, so training
can go on after catching it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zcore.checkpoint.files import CheckpointError, load_json, load_torch
from zcore.checkpoint.rank_files import file_pieces, listed_files
from zcore.checkpoint.rank_state import read_rank_state
from zcore.checkpoint.sharded import FORMAT, resolve_tag
from zcore.zero.layout import GroupLayout, ParamShard, copy_ranges

if TYPE_CHECKING:
    from zcore.checkpoint.parts import CheckpointParts, ShardedPart

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
    """Load a checkpoint written on any world size into ``parts`` (collective).

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
        shard_world = int(manifest["shard_world"])
        counters = {k: int(manifest[k]) for k in parts.counters.state_dict()}
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"`{path / 'manifest.json'}` lacks or mangles {err}; {_DAMAGED}"
        ) from err
    sharded = parts.sharded
    axes = manifest.get("axes") or ["dp"] * len(old_layouts)
    files = listed_files(manifest)
    stages = int((manifest.get("mesh") or {}).get("pp", 1))
    if stages > 1:  # each pipeline stage holds other parameters: read its own stage's files
        files = _stage_files(path, manifest, files, stages, parts.place)
        old_layouts = _first_layouts(path / files[0], old_layouts)
    _check_layouts(path, old_layouts, sharded.layouts, shard_world, axes)
    others = _other_tp(path, manifest, axes, parts.place)
    if load_optimizer:
        _check_optimizer(path, manifest.get("optimizer"), sharded.kind)

    targets = sharded.load_targets()
    masters = [_buffer_for(t, sharded.live()) for t in targets]
    states: list[dict[str, Any]] = [{} for _ in targets]
    copied = [0] * len(targets)
    seen: list[dict[str, ParamShard]] = [{} for _ in targets]
    for name in files:
        got = _read_shard(
            path / name,
            manifest,
            old_layouts,
            sharded,
            masters,
            states if load_optimizer else None,
            seen,
            others.get(name, set()),
        )
        copied = [a + b for a, b in zip(copied, got, strict=True)]
    for g, new in enumerate(sharded.layouts):
        if axes[g] != "dp":  # expert layouts differ per file: check against what they held
            _check_names(path, GroupLayout(tuple(seen[g].values()), 0), new)
        want = sum(hi - lo for lo, hi in (d.owned(sharded.group_rank(g)) for d in new.shards))
        if copied[g] != want:
            raise CheckpointError(
                f"the rank files of `{path}` hold {copied[g]} of the {want} values this rank "
                f"needs in parameter group {g}; {_DAMAGED}"
            )
    common = load_torch(path / "common.pt")
    _check_common(path / "common.pt", common, parts, len(old_layouts))

    state = None
    if load_optimizer:
        current = sharded.param_groups()
        state = {
            "state": {g: s for g, s in enumerate(states) if s},
            "param_groups": [
                {**saved, "params": mine["params"]}
                for saved, mine in zip(common["param_groups"], current, strict=True)
            ],
        }
    per_rank = read_rank_state(parts.place, path, manifest) if load_optimizer else None
    return _Loaded(
        path, targets, masters, state, common, counters, manifest.get("loss_scaler"), per_rank
    )


def _stage_files(
    path: Path, manifest: dict[str, Any], files: list[str], stages: int, place: Any
) -> list[str]:
    """The rank files of this rank's pipeline stage (a checkpoint saved with ``stages``
    pipeline stages loads at the same number of stages only)."""
    mine = int(place.coords.get("pp", 0))
    now = int(place.mesh.get("pp", 1))
    if now != stages:
        raise CheckpointError(
            f"`{path}` was saved with pp {stages} pipeline stages, this engine has pp {now}; "
            f"load it with a PipelineModule of num_stages={stages} (re-cutting a pipeline "
            "checkpoint for another number of stages is not built)"
        )
    info = manifest.get("files") or {}
    return [f for f in files if int(info.get(f, {}).get("pp", 0)) == mine]


def _other_tp(
    path: Path, manifest: dict[str, Any], axes: list[str], place: Any
) -> dict[str, set[int]]:
    """Per rank file of another ``tp`` coordinate, the groups cut by ``tp`` it holds other
    shards of (same names, other values: this rank skips them there). A checkpoint with such
    groups loads at its own ``tp`` only."""
    cut = {g for g, a in enumerate(axes) if a == "tp"}
    saved = int((manifest.get("mesh") or {}).get("tp", 1))
    now = int(place.mesh.get("tp", 1))
    if cut and saved != now:
        raise CheckpointError(
            f"`{path}` holds tensor-parallel shards cut for tp {saved}, this engine has tp "
            f"{now}; load it at tp {saved} (re-cutting tensor-parallel shards for another tp "
            "is not built)"
        )
    mine = int(place.coords.get("tp", 0))
    info = manifest.get("files") or {}
    return {f: cut for f, c in info.items() if cut and int(c.get("tp", 0)) != mine}


def _first_layouts(file: Path, layouts: list[GroupLayout]) -> list[GroupLayout]:
    """The group layouts one rank file of a stage records (the manifest has stage 0's)."""
    groups = load_torch(file).get("groups")
    if not isinstance(groups, list) or len(groups) != len(layouts):
        return layouts
    return [
        old if g is None else GroupLayout.from_json(g["layout"])
        for old, g in zip(layouts, groups, strict=True)
    ]


def _buffer_for(target: torch.Tensor, live: list[torch.Tensor]) -> torch.Tensor:
    """Where the loaded master values of ``target`` go until the commit: a new CPU tensor
    when ``target`` is the live master, ``target`` itself when it is already a new one."""
    ptr = target.untyped_storage().data_ptr()
    if target.numel() and any(m.numel() and m.untyped_storage().data_ptr() == ptr for m in live):
        return torch.zeros(target.shape, dtype=target.dtype)
    return target


def _check_layouts(
    path: Path,
    old_layouts: list[GroupLayout],
    new_layouts: list[GroupLayout],
    shard_world: int,
    axes: list[str],
) -> None:
    """Every trainable parameter of the engine's dense groups is in the checkpoint, with the
    same shape (expert groups: checked against the rank files once they are read)."""
    if len(old_layouts) != len(new_layouts) or len(axes) != len(old_layouts):
        raise CheckpointError(
            f"`{path}` has {len(old_layouts)} parameter groups, the engine has "
            f"{len(new_layouts)}; build the optimizer with the same param groups (and the "
            "model with the same expert layers)"
        )
    for old, new, axis in zip(old_layouts, new_layouts, axes, strict=True):
        if axis != "dp":
            continue
        if old.world != shard_world:
            raise CheckpointError(
                f"`{path / 'manifest.json'}` says {shard_world} rank files but cuts its "
                f"groups for {old.world}; {_DAMAGED}"
            )
        _check_names(path, old, new)


def _check_names(path: Path, old: GroupLayout, new: GroupLayout) -> None:
    """Every parameter of ``new`` is in ``old``, with the same shape."""
    saved = {s.name: s for s in old.shards}
    missing = [d.name for d in new.shards if d.name not in saved]
    if missing:
        raise CheckpointError(
            f"`{path}` has no values for {missing[:5]} (model changed since the save?); "
            "load it into the model it was saved from"
        )
    changed = [
        (d.name, saved[d.name].shape, d.shape)
        for d in new.shards
        if tuple(saved[d.name].shape) != tuple(d.shape)
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


def _read_shard(
    file: Path,
    manifest: dict[str, Any],
    old_layouts: list[GroupLayout],
    sharded: ShardedPart,
    masters: list[torch.Tensor],
    states: list[dict[str, Any]] | None,
    seen: list[dict[str, ParamShard]],
    skip: set[int],
) -> list[int]:
    """Copy what this rank needs from rank file ``file`` into ``masters`` (and ``states``),
    but nothing of the groups in ``skip``; returns how many master values each group got,
    and adds the parameters the file holds to ``seen``."""
    shard = load_torch(file)
    saved_master = shard.get("master") if isinstance(shard, dict) else None
    saved_state = shard.get("optimizer") if isinstance(shard, dict) else None
    pieces = None
    if isinstance(saved_master, list | tuple) and isinstance(saved_state, dict):
        try:
            pieces = file_pieces(manifest, file.name, shard, old_layouts)
        except (KeyError, TypeError, ValueError):
            pieces = None
    if pieces is None or len(saved_master) != len(old_layouts) or len(pieces) != len(old_layouts):
        raise CheckpointError(
            f"`{file}` is not a rank file of this checkpoint (expected master values and "
            f"optimizer state for {len(old_layouts)} parameter groups); {_DAMAGED}"
        )
    copied = []
    for g, new in enumerate(sharded.layouts):
        piece = pieces[g]
        if piece is None or g in skip:
            copied.append(0)
            continue
        old, src = piece
        seen[g].update((s.name, s) for s in old.shards)
        values = saved_master[g]
        if not torch.is_tensor(values) or values.ndim != 1 or values.numel() != old.numel:
            got = list(values.shape) if torch.is_tensor(values) else type(values).__name__
            raise CheckpointError(
                f"`{file}` holds master values of shape {got} for parameter group {g}, the "
                f"manifest says [{old.numel}]; {_DAMAGED}"
            )
        try:
            copied.append(copy_ranges(masters[g], new, sharded.group_rank(g), values, old, src))
        except ValueError as err:  # a shape differs (dense groups are checked before)
            raise CheckpointError(
                f"`{file}`: {err}; load it into the model it was saved from"
            ) from err
        if states is None:
            continue
        for key, value in saved_state.get(g, {}).items():
            if torch.is_tensor(value) and value.ndim == 1 and value.numel() == old.numel:
                mine = states[g].get(key)
                if mine is None:
                    mine = states[g][key] = torch.zeros(new.numel, dtype=value.dtype)
                copy_ranges(mine, new, sharded.group_rank(g), value, old, src)
            elif key not in states[g]:  # per-group scalars (the step count): same everywhere
                states[g][key] = value.clone() if torch.is_tensor(value) else value
    return copied


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
