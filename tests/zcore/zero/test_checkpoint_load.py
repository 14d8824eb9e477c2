"""Loading a checkpoint that is damaged or does not fit the engine: a clear error, and the
engine (master weights, optimizer moments, model parameters, counters) exactly as it was."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import DIM, config, full_params, make_model, train
from zcore.checkpoint import CheckpointError
from zcore.zero.layout import GroupLayout, copy_ranges

GLOBAL = 8  # samples per step, as in test_checkpoint.py


def _cfg(stage: int, world: int, **extra: Any) -> dict:
    return config(stage, mb=GLOBAL // (2 * world), gas=2, **extra)


def _snapshot(engine: Any) -> dict[str, Any]:
    """Everything a load may change, cloned."""
    zopt, inner = engine.zopt, engine.zopt.optimizer
    state = {}
    for g, m in enumerate(zopt.master):
        st = inner.state.get(m, {})
        state[g] = {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
    return {
        "master": [m.detach().clone() for m in zopt.master],
        "state": state,
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
        "params": full_params(engine),
        "counters": (engine.global_steps, engine.micro_steps, engine.global_samples),
    }


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two snapshots, bit for bit (empty: identical)."""
    out = []
    for g, (x, y) in enumerate(zip(a["master"], b["master"], strict=True)):
        if not torch.equal(x, y):
            out.append(f"master[{g}]")
    for g in a["state"]:
        x, y = a["state"][g], b["state"].get(g, {})
        if x.keys() != y.keys():
            out.append(f"state[{g}] keys {sorted(x)} != {sorted(y)}")
            continue
        for k in x:
            same = torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k]
            if not same:
                out.append(f"state[{g}][{k}]")
    if a["groups"] != b["groups"]:
        out.append("param_groups")
    out += [f"param {k}" for k in a["params"] if not torch.equal(a["params"][k], b["params"][k])]
    if a["counters"] != b["counters"]:
        out.append(f"counters {a['counters']} != {b['counters']}")
    return out


def _attempt(engine: Any, root: Path, tag: str, **kwargs: Any) -> tuple[str, list[str]]:
    """Try a load that must fail; return its message ("" if it did not) and what changed."""
    before = _snapshot(engine)
    try:
        engine.load_checkpoint(str(root), tag=tag, **kwargs)
    except CheckpointError as err:
        message = str(err)
    else:
        message = ""
    return message, _diff(before, _snapshot(engine))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# (tag, damage, file the error must name)
DAMAGE = [
    ("no-rank1", lambda d: (d / "rank_00001.pt").unlink(), "rank_00001.pt"),
    ("cut-rank1", lambda d: _truncate(d / "rank_00001.pt"), "rank_00001.pt"),
    ("no-common", lambda d: (d / "common.pt").unlink(), "common.pt"),
    ("cut-common", lambda d: _truncate(d / "common.pt"), "common.pt"),
]


def _damaged_loads(rank: int, world: int, stage: int, root: str) -> dict[str, Any]:
    ckpt = Path(root) / "ckpt"
    ref, *_ = zcore.initialize(make_model(), config=_cfg(stage, world))
    ref_losses = train(ref, 6)  # never attempts a load
    ref_end = _snapshot(ref)
    ref.destroy()

    engine, *_ = zcore.initialize(make_model(), config=_cfg(stage, world))
    losses = train(engine, 2)
    engine.save_checkpoint(str(ckpt), tag="old")
    losses += train(engine, 2, start=2)  # the engine has moved on from "old"
    if rank == 0:
        for tag, damage, _ in DAMAGE:
            shutil.copytree(ckpt / "old", ckpt / tag)
            damage(ckpt / tag)
        # per-rank load dirs (node-local disks): only rank 1's copy is damaged
        for r in range(world):
            shutil.copytree(ckpt, Path(root) / f"local{r}")
        _truncate(Path(root) / "local1" / "old" / "common.pt")
    dist.barrier()

    results = {tag: _attempt(engine, ckpt, tag) for tag, _, _ in DAMAGE}
    results["one-rank"] = _attempt(engine, Path(root) / f"local{rank}", "old")
    losses += train(engine, 2, start=4)
    return {
        "results": results,
        "losses": losses,
        "ref_losses": ref_losses,
        "vs_ref": _diff(ref_end, _snapshot(engine)),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_a_damaged_checkpoint_changes_nothing_and_training_goes_on(
    tmp_path: Path, stage: int
) -> None:
    out = run_ranks(_damaged_loads, 2, args=(stage, str(tmp_path)))
    for rank, got in enumerate(out):
        for tag, _, file in DAMAGE:
            message, changed = got["results"][tag]
            assert file in message and tag in message, (rank, tag, message)
            assert changed == [], (rank, tag, changed)
        message, changed = got["results"]["one-rank"]
        if rank == 1:
            assert "common.pt" in message, message
        else:
            assert "another rank" in message and "nothing was loaded" in message, message
        assert changed == [], (rank, "one-rank", changed)
        # bit-identical to the engine that never tried to load
        assert got["losses"] == got["ref_losses"]
        assert got["vs_ref"] == []


def _wider_vocab_model() -> nn.Module:
    """The test LM with 6 more tokens: same parameter names, other shapes."""
    model = make_model(seed=5)
    model.emb = nn.Embedding(67, DIM)
    model.head = nn.Linear(DIM, 67, bias=False)
    model.head.weight = model.emb.weight
    return model


def _changed_shapes(rank: int, world: int, root: str) -> tuple[str, list[str]]:
    first, *_ = zcore.initialize(make_model(), config=_cfg(2, world))
    train(first, 2)
    first.save_checkpoint(root, tag="vocab61")
    first.destroy()
    engine, *_ = zcore.initialize(_wider_vocab_model(), config=_cfg(2, world))
    return _attempt(engine, Path(root), "vocab61")


def test_a_parameter_with_another_shape_is_refused_by_name(tmp_path: Path) -> None:
    for message, changed in run_ranks(_changed_shapes, 2, args=(str(tmp_path),)):
        assert "`emb.weight`" in message, message
        assert "[61, 24]" in message and "[67, 24]" in message, message
        assert "consolidate" in message, message  # the way out
        assert changed == []


def _other_optimizer(rank: int, world: int, root: str) -> dict[str, Any]:
    sgd = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    first, *_ = zcore.initialize(make_model(), config=_cfg(2, world, optimizer=sgd))
    train(first, 2)
    first.save_checkpoint(root, tag="sgd")
    sgd_params = full_params(first)
    first.destroy()

    engine, *_ = zcore.initialize(make_model(seed=3), config=_cfg(2, world))  # AdamW
    train(engine, 1)
    message, changed = _attempt(engine, Path(root), "sgd")
    # the way out the message names: the weights alone, Adam's state starts afresh
    engine.load_checkpoint(root, tag="sgd", load_optimizer_states=False)
    loaded = full_params(engine)
    weights_loaded = all(torch.equal(loaded[k], v) for k, v in sgd_params.items())
    train(engine, 1, start=2)
    return {"message": message, "changed": changed, "weights_loaded": weights_loaded}


def test_an_optimizer_of_another_kind_is_refused_at_load(tmp_path: Path) -> None:
    for got in run_ranks(_other_optimizer, 2, args=(str(tmp_path),)):
        message = got["message"]
        assert "SGD" in message and "CPUAdam" in message, message
        assert "load_optimizer_states=False" in message, message
        assert got["changed"] == []
        assert got["weights_loaded"]


def test_copy_ranges_refuses_a_name_with_another_shape() -> None:
    old = GroupLayout.build([("w", (4, 6))], world=2)
    new = GroupLayout.build([("w", (6, 4))], world=1)
    dst = torch.zeros(new.numel)
    with pytest.raises(ValueError, match=r"`w`.*\(4, 6\).*\(6, 4\)"):
        copy_ranges(dst, new, 0, torch.ones(old.numel), old, 0)
    assert not dst.any()
