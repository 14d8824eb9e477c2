from __future__ import annotations

import io

import pytest

from ztrain.progress import TrainProgress, format_duration, format_metrics


def _run(p: TrainProgress) -> None:
    with p:
        for step in (1, 2, 3):
            p.update(
                step=step,
                loss=5.0 / step,
                tokens_per_s=12345.6,
                rank_rss_mib=[512.4, 498.0],
                val_loss=4.25 if step == 2 else None,
            )
        p.log("sample: O Romeo")


def test_disabled_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    _run(TrainProgress(3, enabled=False))
    assert capsys.readouterr() == ("", "")


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    p = TrainProgress(3, file=out)
    assert not p.live
    _run(p)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4
    assert lines[0].startswith(
        "train step 1/3 · loss 5.0000 · 12,346 tok/s · rss r0 512 r1 498 MiB"
    )
    assert "val" not in lines[0]
    assert "val 4.2500" in lines[1] and "val 4.2500" in lines[2]  # the last val loss stays
    assert lines[2].endswith("eta 0:00")
    assert lines[3] == "sample: O Romeo"


def test_stdout_capture_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    _run(TrainProgress(3))
    assert capsys.readouterr().out.count("\n") == 4


def test_live_bar_on_a_terminal() -> None:
    out = io.StringIO()
    p = TrainProgress(3, file=out, force_terminal=True)
    assert p.live
    _run(p)
    text = out.getvalue()
    assert "3/3" in text and "loss 1.6667" in text
    assert "sample: O Romeo" in text


def test_formatting_helpers() -> None:
    assert format_metrics(None, None, None, []) == ""
    assert (
        format_metrics(1.0, 2.0, 3.0, [4.0]) == "loss 1.0000 · val 2.0000 · 3 tok/s · rss r0 4 MiB"
    )
    assert format_duration(3723) == "1:02:03"
    assert format_duration(65) == "1:05"
    assert format_duration(float("nan")) == "-:--"
