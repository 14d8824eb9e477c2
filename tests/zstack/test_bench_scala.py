"""The ScaLA bench's protocol (`benchmarks/_scala_sweep.py`) and its defaults (`_scala`)."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest

from zcore.scala import load_scala_config
from zstack.bench import load


def _curve(accs: list[float], every: int = 2) -> list[dict[str, Any]]:
    return [{"step": every * (i + 1), "accuracy": a} for i, a in enumerate(accs)]


def _run(arm: str, cfg: dict[str, Any], accs: list[float], s_per_step: float = 0.1) -> dict:
    return {
        "arm": arm,
        "config": cfg,
        "curve": _curve(accs),
        "final_accuracy": accs[-1],
        "s_per_step": s_per_step,
    }


def test_bench_defaults_are_the_measured_protocol_settings() -> None:
    """`z bench efficiency --sections scala` runs what the protocol measured."""
    sc, sw = load("_scala"), load("_scala_sweep")
    defaults = {k: p.default for k, p in inspect.signature(sc.scala_section).parameters.items()}
    for key, value in sw.PROTOCOL.items():
        assert defaults[key] == value, key
    seeds = range(defaults["seed"], defaults["seed"] + defaults["seeds"])
    assert tuple(seeds) == sw.MEASURE_SEEDS
    assert not set(sw.TUNE_SEEDS) & set(sw.MEASURE_SEEDS)  # tuning seeds are never reported
    picked = {
        "lr": defaults["scala_lr"],
        "adv_steps": defaults["adv_steps"],
        "adv_start_step": defaults["adv_start_step"],
        "adv_max_norm": defaults["adv_max_norm"],
        "adv_step_size": defaults["adv_step_size"],
    }
    assert picked in sw.scala_grid(defaults["lr"])  # ScaLA's pick came from the grid
    assert defaults["lr"] in sw.BASE_LRS


def test_scala_grid_is_unique_and_every_point_is_a_valid_scala_block() -> None:
    grid = load("_scala_sweep").scala_grid(1e-3)
    assert len(grid) == 28
    assert len({json.dumps(c, sort_keys=True) for c in grid}) == len(grid)
    for c in grid:
        cfg = load_scala_config({"enabled": True, **{k: v for k, v in c.items() if k != "lr"}})
        assert cfg.adv_step_size == cfg.adv_max_norm == c["adv_max_norm"]
    assert {c["lr"] for c in grid} == {1e-3, 2e-3, 4e-3}


def test_pick_takes_fewest_mean_steps_then_higher_final_and_skips_incomplete_configs() -> None:
    sw = load("_scala_sweep")
    assert sw.TUNE_SEEDS == (10, 11)
    a, b, c, d = {"lr": 1.0}, {"lr": 2.0}, {"lr": 3.0}, {"lr": 4.0}
    runs = [
        _run("x", a, [0.2, 0.5, 0.5]),  # step 4
        _run("x", a, [0.2, 0.3, 0.5]),  # step 6: a's mean 5
        _run("x", b, [0.5, 0.5, 0.45]),  # step 2
        _run("x", b, [0.2, 0.2, 0.5]),  # step 6: b's mean 4
        _run("x", c, [0.2, 0.5, 0.6]),  # step 4
        _run("x", c, [0.5, 0.5, 0.6]),  # step 2: c's mean 3
        _run("x", d, [0.6, 0.6, 0.6]),  # one tuning seed only: not eligible
    ]
    picked, table = sw._pick(runs, target=0.5)
    assert picked == c
    assert [t["config"] for t in table] == [c, b, a]
    assert table[0]["steps"] == [4, 2] and table[0]["mean_steps"] == 3.0
    # a tie in mean steps goes to the higher mean final accuracy; a miss counts max_steps + 1
    tie = [
        _run("x", a, [0.5, 0.5, 0.5]),
        _run("x", a, [0.1, 0.1, 0.1]),
        _run("x", b, [0.5, 0.5, 0.7]),
        _run("x", b, [0.1, 0.1, 0.1]),
    ]
    picked, table = sw._pick(tie, target=0.5)
    assert picked == b
    assert table[0]["mean_steps"] == (2 + sw.PROTOCOL["max_steps"] + 1) / 2


def test_summarize_sets_the_target_from_the_baseline_alone_and_counts_steps() -> None:
    sw = load("_scala_sweep")
    base = [
        _run("baseline", {}, accs, 0.03)
        for accs in ([0.1, 0.3, 0.38, 0.40], [0.1, 0.2, 0.3, 0.39], [0.2, 0.38, 0.4, 0.41])
    ]
    scala = [
        _run("scala", {}, accs, 0.045)
        for accs in ([0.1, 0.39, 0.4, 0.4], [0.1, 0.2, 0.3, 0.33], [0.4, 0.4, 0.4, 0.9])
    ]
    out = sw.summarize({"baseline": base, "scala": scala})
    assert out["target"] == round(0.95 * 0.40, 4)  # the baseline's median final: scala's .9 no
    assert out["baseline"]["steps_to_target"]["per_seed"] == [6, 8, 4]
    assert out["scala"]["steps_to_target"]["per_seed"] == [4, None, 2]
    assert out["scala"]["steps_to_target"]["median"] == 4  # the miss counts max_steps + 1
    assert out["step_ratio"] == round(4 / 6, 3) and out["fewer_steps"]
    assert out["s_per_step_ratio"] == 1.5


@pytest.mark.slow  # ~8 s quiet, ~25 s at load 9: loading transformers and MiniLM dominates
def test_scala_section_runs_both_arms_end_to_end_on_a_tiny_task() -> None:
    """Both arms through the real engine and model (4 lines a play, 2 steps of 8)."""
    sc = load("_scala")
    out = sc.scala_section(
        seeds=1,
        batch=8,
        max_steps=2,
        eval_every=1,
        warmup=1,
        per_class_train=4,
        per_class_eval=2,
        adv_start_step=0,
        device="cpu",
    )
    assert out["train_lines"] == 24 and out["eval_lines"] == 12
    for arm in ("baseline", "scala"):
        (run,) = out[arm]["runs"]
        assert [p["step"] for p in run["curve"]] == [1, 2]
        assert 0.0 <= run["final_accuracy"] <= 1.0
    assert out["settings"]["device"] == "cpu"
    with pytest.raises(ValueError, match="device 'tpu'"):
        sc.resolve_device("tpu")
