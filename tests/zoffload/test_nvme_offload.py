"""ZeRO-Infinity optimizer offload to NVMe: same training as without offload, swap files
that come and go with the engine, and IO faults that stop training cleanly."""

from __future__ import annotations

import functools
import math
import resource
from pathlib import Path
from typing import Any

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, full_params, make_model, micro_batch, train
from tests.zoffload.equivalence import assert_matches, offload_vs_plain
from zcore.memory import model_state_bytes

TILE = 1024  # elements: each rank's ~4k-element partition walks four tiles (three sets rotate)


def nvme(path: Path) -> dict[str, Any]:
    path.mkdir(parents=True, exist_ok=True)
    return {"device": "nvme", "nvme_path": str(path)}


def nvme_config(stage: int, path: Path, **extra: Any) -> dict[str, Any]:
    return config(
        stage,
        zero_optimization={"offload_optimizer": nvme(path), "sub_group_size": TILE},
        aio={"block_size": 4096, "queue_depth": 8},
        **extra,
    )


@pytest.mark.parametrize(
    ("stage", "pipeline"),
    [(2, True), (3, True), pytest.param(2, False, marks=pytest.mark.slow)],
    ids=["2", "3", "2-serial"],
)
def test_nvme_offload_matches_plain_training(stage: int, pipeline: bool, tmp_path: Path) -> None:
    offload = {**nvme(tmp_path / "nvme"), "pipeline_read": pipeline, "pipeline_write": pipeline}
    args = (stage, offload, str(tmp_path / "ckpt"), 10, {"sub_group_size": TILE})
    results = run_ranks(offload_vs_plain, 2, args=args, timeout=300)
    for got in results:
        assert got["zopt"] == "NvmeStore"
        assert_matches(got)
    assert list((tmp_path / "nvme").iterdir()) == []  # swap files removed with the engines


def test_nvme_adagrad_starts_from_its_initial_accumulator(tmp_path: Path) -> None:
    """The swapped ``sum`` starts at ``initial_accumulator_value``, as CPUAdagrad's does
    in memory (the swap files used to start at zero whatever the value)."""
    adagrad = {"type": "Adagrad", "params": {"lr": 3e-2, "initial_accumulator_value": 0.5}}
    args = (2, nvme(tmp_path / "nvme"), str(tmp_path / "ckpt"), 6, {"sub_group_size": TILE})
    fn = functools.partial(offload_vs_plain, optimizer=adagrad)
    for got in run_ranks(fn, 2, args=args, timeout=300):
        assert got["zopt"] == "NvmeStore"
        assert_matches(got)


def _bf16_states(rank: int, world: int, root: str) -> str:
    from zcore.optim import CPUAdam

    model = make_model()
    opt = CPUAdam(model.parameters(), lr=1e-3, state_dtype=torch.bfloat16)
    cfg = nvme_config(2, Path(root))
    del cfg["optimizer"]
    try:
        zcore.initialize(model, optimizer=opt, config=cfg)
    except ValueError as err:
        return str(err)
    return ""


def test_bf16_states_are_refused_by_nvme_offload_with_the_fix(tmp_path: Path) -> None:
    for msg in run_ranks(_bf16_states, 2, args=(str(tmp_path / "nvme"),), timeout=120):
        assert "state_dtype=torch.bfloat16" in msg and "state_dtype=torch.float32" in msg


def _swap_state(rank: int, world: int, root: str) -> dict[str, Any]:
    engine, *_ = zcore.initialize(make_model(), config=nvme_config(2, Path(root)))
    train(engine, 2)
    zopt, store = engine.zopt, engine.zopt.store
    files = sorted(p.name for p in store.swap.root.iterdir())
    out = {
        "files": files,
        "nvme_bytes": store.nvme_bytes(),
        "host_optimizer_bytes": zopt.optimizer_bytes(),
        "partition": sum(store.numels),
        "tile": store.tile,
    }
    engine.destroy()
    out["left_after_destroy"] = store.swap.root.parent.exists()
    return out


def test_master_and_adam_state_live_in_swap_files(tmp_path: Path) -> None:
    for got in run_ranks(_swap_state, 2, args=(str(tmp_path / "nvme"),)):
        assert got["files"] == [
            "g0.exp_avg.swp",
            "g0.exp_avg_sq.swp",
            "g0.grad.swp",
            "g0.master.swp",
        ]
        assert got["nvme_bytes"] == 4 * 4 * got["partition"]
        # what the estimator (`z estimate-memory`) says NVMe offload puts there
        est = model_state_bytes(got["partition"] * 2, 2, 2, offload_optimizer="nvme")
        assert est.nvme_per_rank == got["nvme_bytes"] and est.host_grads == 0
        # host memory: three tile sets (read-ahead, compute, write-behind), each the master,
        # two moments and a gradient copy; not the partition
        assert got["host_optimizer_bytes"] == 3 * 4 * 4 * got["tile"]
        assert not got["left_after_destroy"]


def _start(rank: int, world: int, path: str) -> str:
    cfg = config(2, zero_optimization={"offload_optimizer": {"device": "nvme", "nvme_path": path}})
    try:
        zcore.initialize(make_model(), config=cfg)
    except OSError as err:
        return str(err)
    return "started"


def test_missing_or_bad_nvme_path_fails_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    for message in run_ranks(_start, 2, args=(str(missing),)):
        assert str(missing) in message and "does not exist" in message
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for message in run_ranks(_start, 2, args=(str(a_file),)):
        assert str(a_file) in message and "not a directory" in message


def _fault(rank: int, world: int, root: str, ckpt: str, kind: str) -> dict[str, Any]:
    engine, *_ = zcore.initialize(make_model(), config=nvme_config(2, Path(root)))
    train(engine, 2)
    engine.save_checkpoint(ckpt)
    train(engine, 1, start=2)
    swap = engine.zopt.store.swap.path("g0.exp_avg")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 0 and kind == "corrupt":
        with open(swap, "r+b") as f:  # flip bytes inside the second tile
            f.seek(TILE * 4 + 100)
            f.write(b"\xff" * 64)
    if rank == 0 and kind == "file_size_limit":  # as a full disk would: writes fail (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    error = ""
    try:
        train(engine, 1, start=3)
    except OSError as err:
        error = str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    engine.destroy()
    # the last checkpoint still loads and trains
    fresh, *_ = zcore.initialize(make_model(seed=3), config=nvme_config(2, Path(root)))
    fresh.load_checkpoint(ckpt)
    losses = train(fresh, 1, start=2)
    params = full_params(fresh)
    fresh.destroy()
    return {"error": error, "swap": str(swap), "losses": losses, "params": params}


def _load_fault(rank: int, world: int, root: str, ckpt: str) -> dict[str, str]:
    """A load whose swap-file writes fail (as on a full disk) leaves the engine refusing
    to step until a load succeeds."""
    engine, *_ = zcore.initialize(make_model(), config=nvme_config(2, Path(root)))
    train(engine, 2)
    engine.save_checkpoint(ckpt)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    out = {}
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        engine.load_checkpoint(ckpt)
        out["load"] = ""
    except OSError as err:
        out["load"] = str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    try:
        train(engine, 1, start=2)
        out["step"] = ""
    except OSError as err:
        out["step"] = str(err)
    engine.load_checkpoint(ckpt)
    out["next"] = str(train(engine, 1, start=2))
    engine.destroy()
    return out


def test_a_load_that_fails_writing_swap_files_blocks_steps_until_a_load_succeeds(
    tmp_path: Path,
) -> None:
    args = (str(tmp_path / "nvme"), str(tmp_path / "ckpt"))
    first, other = run_ranks(_load_fault, 2, args=args, timeout=300)
    for got in (first, other):
        assert "File too large" in got["load"] or "EFBIG" in got["load"], got["load"]
        assert "checkpoint load failed part-way" in got["step"], got["step"]
        assert "engine.load_checkpoint" in got["step"]
    assert first["next"] == other["next"]


@pytest.mark.parametrize("kind", ["corrupt", "file_size_limit"])
def test_swap_faults_stop_every_rank_and_the_checkpoint_still_loads(
    kind: str, tmp_path: Path
) -> None:
    ckpt = str(tmp_path / "ckpt")
    got = run_ranks(_fault, 2, args=(str(tmp_path / "nvme"), ckpt, kind), timeout=300)
    first, other = got
    assert first["swap"] in first["error"] or "swap" in first["error"]
    if kind == "corrupt":
        assert "corrupt" in first["error"] and first["swap"] in first["error"]
    else:
        assert "File too large" in first["error"] or "EFBIG" in first["error"]
        assert "free space" in first["error"]
    assert "another rank" in other["error"]
    # both ranks resumed from the checkpoint to the same state
    assert first["losses"] == other["losses"]
    for name, value in first["params"].items():
        torch.testing.assert_close(other["params"][name], value, atol=0, rtol=0)


def _grad_fault(rank: int, world: int, root: str, ckpt: str, when: str) -> dict[str, Any]:
    """Corrupt a written gradient slot on rank 0, before the next micro-step adds to it
    (``when="accumulate"``) or before the step reads it back (``when="step"``); then try
    to go on."""
    engine, *_ = zcore.initialize(make_model(), config=nvme_config(2, Path(root)))
    train(engine, 1)
    engine.save_checkpoint(ckpt)
    before = full_params(engine)
    zopt = engine.zopt
    swapped = zopt.master_for_save()
    gas, mb = engine.batch.gradient_accumulation_steps, engine.batch.micro_batch_size
    corrupt_after = 0 if when == "accumulate" else gas - 1
    error = ""
    try:
        for micro in range(gas):
            x, y = micro_batch(1, micro, rank, world, mb, gas)
            engine.backward(engine(x, y))
            if rank == 0 and micro == corrupt_after:
                zopt.store._finish_grad_writes()  # the slots are on the file
                g, offset = max(zopt.store._written)  # the last slot of the partition
                with open(zopt.store.swap.path(f"g{g}.grad"), "r+b") as f:
                    f.seek(offset * 4 + 4)
                    f.write(b"\xff" * 8)
            engine.step()
    except OSError as err:
        error = str(err)
    out: dict[str, Any] = {"error": error, "before": before, "after": full_params(engine)}
    out["swap"] = str(zopt.store.swap.path("g0.grad"))
    if when == "accumulate":
        # found before any rank stepped: nothing moved, and training goes on
        out["swapped_unchanged"] = all(
            torch.equal(a, b) for a, b in zip(zopt.master_for_save(), swapped, strict=True)
        )
        out["next"] = train(engine, 1, start=1)
    else:
        # found part-way: stepping on and saving are refused until a checkpoint loads
        for attempt in ("step", "save"):
            try:
                if attempt == "step":
                    train(engine, 1, start=1)
                else:
                    engine.save_checkpoint(ckpt)
                out[attempt] = ""
            except OSError as err:
                out[attempt] = str(err)
        engine.load_checkpoint(ckpt)
        out["next"] = train(engine, 1, start=1)
    engine.destroy()
    return out


@pytest.mark.parametrize("when", ["accumulate", "step"])
def test_a_corrupt_gradient_slot_stops_the_step_before_any_weight_moves(
    when: str, tmp_path: Path
) -> None:
    args = (str(tmp_path / "nvme"), str(tmp_path / "ckpt"), when)
    first, other = run_ranks(_grad_fault, 2, args=args, timeout=300)
    assert "corrupt" in first["error"] and "gradient slot" in first["error"]
    assert first["swap"] in first["error"] and "restart from the last checkpoint" in first["error"]
    assert "another rank" in other["error"]
    for got in (first, other):
        for name, value in got["before"].items():
            torch.testing.assert_close(got["after"][name], value, atol=0, rtol=0)
        assert len(got["next"]) == 1 and math.isfinite(got["next"][0])
        if when == "accumulate":
            assert got["swapped_unchanged"]
        else:
            for attempt in ("step", "save"):
                assert "failed part-way" in got[attempt], got[attempt]
                assert "engine.load_checkpoint" in got[attempt]
    # both ranks trained the step after it from the same state
    assert first["next"] == other["next"]


def _edit(rank: int, world: int, root: str, offloaded: bool) -> dict[str, torch.Tensor]:
    from zcore.zero import GatheredParameters

    cfg = nvme_config(3, Path(root)) if offloaded else config(3)
    engine, *_ = zcore.initialize(make_model(), config=cfg)
    train(engine, 1)
    fc = engine.module.blocks[0].fc.weight
    with GatheredParameters([fc], modifier_rank=0):
        if rank == 0:
            fc.data.mul_(0.5)  # an edit the master weights (on NVMe) must take in
    train(engine, 2, start=1)
    params = full_params(engine)
    engine.destroy()
    return params


def test_gathered_parameters_edits_reach_the_swapped_master(tmp_path: Path) -> None:
    want = run_ranks(_edit, 2, args=(str(tmp_path / "nvme"), False))[0]
    for got in run_ranks(_edit, 2, args=(str(tmp_path / "nvme"), True)):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=1e-5, rtol=0, msg=name)


def test_swap_directory_goes_with_close_or_collection(tmp_path: Path) -> None:
    import gc

    from zoffload.aio import AioHandle
    from zoffload.swap import SwapSpace

    aio = AioHandle({"block_size": 4096, "queue_depth": 4})
    closed = SwapSpace.create(tmp_path, 0, aio)
    closed.write("t", torch.arange(1024, dtype=torch.float32), 0).wait()
    assert closed.root.is_dir()
    closed.close()
    closed.close()  # idempotent
    assert not closed.root.exists()

    dropped = SwapSpace.create(tmp_path, 1, aio)
    root = dropped.root
    assert root.is_dir()
    del dropped
    gc.collect()
    assert not root.exists() and list(tmp_path.iterdir()) == []
