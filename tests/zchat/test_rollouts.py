"""zchat.rollouts.rollout_loop, the loop PPO and GRPO share: what it records and when it
evaluates, on plain callables (no model), one process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from zchat.rollouts import rollout_loop
from zchat.train_loop import Recorder


def _run(tmp_path: Path, steps: int, **kw: Any) -> tuple[list[dict[str, Any]], Any, Any, str]:
    evals = iter(range(100))
    rec = Recorder("x", tmp_path / "out", steps, 0, path=tmp_path / "out" / "metrics.jsonl")
    before, after = rollout_loop(
        rec,
        steps,
        lambda s: {"step": s + 1, "loss": 0.5 * s},
        lambda: {"heldout_accuracy": float(next(evals))},
        lambda m: f"x step {m['step']}/{steps}",
        **kw,
    )
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines], before, after, str(rec.path)


def test_each_evaluation_is_a_record_and_eval_every_adds_some_between(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records, before, after, _ = _run(tmp_path, 5, eval_every=2)
    assert records == [
        {"eval": "before", "step": 0, "heldout_accuracy": 0.0},
        {"step": 1, "loss": 0.0},
        {"step": 2, "loss": 0.5},
        {"eval": "during", "step": 2, "heldout_accuracy": 1.0},
        {"step": 3, "loss": 1.0},
        {"step": 4, "loss": 1.5},
        {"eval": "during", "step": 4, "heldout_accuracy": 2.0},
        {"step": 5, "loss": 2.0},
        {"eval": "after", "step": 5, "heldout_accuracy": 3.0},
    ]
    assert (before, after) == ({"heldout_accuracy": 0.0}, {"heldout_accuracy": 3.0})
    err = capsys.readouterr().err
    assert err == "".join(f"\rx step {s}/5" for s in range(1, 6)) + "\n"


def test_before_after_is_one_record_after_the_last_step(tmp_path: Path) -> None:
    records, *_ = _run(tmp_path, 2, evals="before_after")
    assert records == [
        {"step": 1, "loss": 0.0},
        {"step": 2, "loss": 0.5},
        {
            "eval": "before_after",
            "before": {"heldout_accuracy": 0.0},
            "after": {"heldout_accuracy": 1.0},
        },
    ]


def test_only_rank_0_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = Recorder("x", tmp_path / "out", 1, 1, path=tmp_path / "m.jsonl")
    rollout_loop(rec, 1, lambda s: {"step": 1}, dict, lambda m: "line")
    assert not (tmp_path / "m.jsonl").exists() and capsys.readouterr().err == ""
