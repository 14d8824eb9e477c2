from __future__ import annotations

import json
import math
from pathlib import Path

from ztrain.metrics import JsonlWriter, plot_loss_curve, read_jsonl


def _write_run(path: Path) -> None:
    with JsonlWriter(path) as w:
        for step in range(1, 41):
            record = {"step": step, "loss": 7.6 * math.exp(-step / 15), "tokens_per_s": 1e4}
            if step % 10 == 0:
                record["val_loss"] = record["loss"] + 0.2
            w.write(record)


def test_jsonl_lines_are_flushed_and_appended(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    w = JsonlWriter(path)
    w.write({"step": 1, "loss": 2.5})
    assert json.loads(path.read_text()) == {"step": 1, "loss": 2.5}  # visible before close
    w.close()
    w.close()
    with JsonlWriter(path) as again:
        again.write({"step": 2, "val_loss": 2.0})
    assert read_jsonl(path) == [{"step": 1, "loss": 2.5}, {"step": 2, "val_loss": 2.0}]


def test_read_jsonl_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1, "loss": 3.0}]


def test_loss_curve_png(tmp_path: Path) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    _write_run(jsonl)
    png = plot_loss_curve(jsonl, tmp_path / "plots" / "loss.png")
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000
    assert sorted(p.name for p in png.parent.iterdir()) == ["loss.png"]


def test_loss_curve_of_an_empty_run(tmp_path: Path) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("")
    assert plot_loss_curve(jsonl, tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
