"""zcore.monitor: CSV files read back with `csv`, TensorBoard event files read back with
TensorBoard's EventAccumulator, rank gating, default paths, and the error paths."""

from __future__ import annotations

import csv
import errno
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from zcore.monitor import CSVMonitor, Monitor, MonitorMaster, TensorBoardMonitor

EVENTS = [
    [("Train/Samples/lr", 1e-4, 0), ("Train/Samples/train_loss", 7.25, 0)],
    [("Train/Samples/lr", 2.5e-4, 8), ("Train/Samples/train_loss", 6.125, 8)],
    [("Train/Samples/lr", 3.0e-4, 16)],
]


def read_csv(path: Path) -> list[list[str]]:
    with path.open(newline="") as f:
        return list(csv.reader(f))


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected_by_tag() -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for batch in EVENTS:
        for tag, value, step in batch:
            out.setdefault(tag, []).append((step, value))
    return out


def test_csv_monitor_writes_one_file_per_tag(tmp_path):
    mon = CSVMonitor(str(tmp_path), "job")
    assert isinstance(mon, Monitor)
    for batch in EVENTS:
        mon.write_events(batch)
        # Flushed on every write: readable before close, as after a crash.
        assert (tmp_path / "job" / "Train_Samples_lr.csv").stat().st_size > 0
    lr_rows = read_csv(tmp_path / "job" / "Train_Samples_lr.csv")
    loss_rows = read_csv(tmp_path / "job" / "Train_Samples_train_loss.csv")
    mon.close()
    mon.close()  # idempotent
    assert lr_rows[0] == ["step", "Train/Samples/lr"]
    assert [(int(s), float(v)) for s, v in lr_rows[1:]] == expected_by_tag()["Train/Samples/lr"]
    assert loss_rows[0] == ["step", "Train/Samples/train_loss"]
    assert [(int(s), float(v)) for s, v in loss_rows[1:]] == [(0, 7.25), (8, 6.125)]
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == [
        "Train_Samples_lr.csv",
        "Train_Samples_train_loss.csv",
    ]
    with pytest.raises(RuntimeError, match="closed"):
        mon.write_events(EVENTS[0])


def test_csv_monitor_restart_appends_without_second_header(tmp_path):
    with MonitorMaster(csv={"enabled": True, "output_path": str(tmp_path), "job_name": "j"}) as m:
        m.write_events([("loss", 1.5, 1)])
    with MonitorMaster(csv={"enabled": True, "output_path": str(tmp_path), "job_name": "j"}) as m:
        m.write_events([("loss", 1.25, 2)])
    assert read_csv(tmp_path / "j" / "loss.csv") == [["step", "loss"], ["1", "1.5"], ["2", "1.25"]]


def test_tensorboard_monitor_round_trip(tmp_path):
    mon = TensorBoardMonitor(tmp_path, "tb_job")
    assert isinstance(mon, Monitor)
    for batch in EVENTS:
        mon.write_events(batch)
    # Flushed after each write: readable before close.
    assert set(read_scalars(tmp_path / "tb_job")) == set(expected_by_tag())
    mon.close()
    got = read_scalars(tmp_path / "tb_job")
    for tag, want in expected_by_tag().items():
        assert [s for s, _ in got[tag]] == [s for s, _ in want]
        # TensorBoard stores scalars as float32.
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in want], rel=1e-6)
    with pytest.raises(RuntimeError, match="closed"):
        mon.write_events(EVENTS[0])


def test_monitor_master_writes_to_both(tmp_path):
    csv_cfg = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run1"}
    tb_cfg = {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run1"}
    with MonitorMaster(csv=csv_cfg, tensorboard=tb_cfg, rank=0) as master:
        assert master.enabled and len(master.monitors) == 2
        for batch in EVENTS:
            master.write_events(batch)
    assert master.monitors == []
    rows = read_csv(tmp_path / "csv" / "run1" / "Train_Samples_lr.csv")
    assert [(int(s), float(v)) for s, v in rows[1:]] == expected_by_tag()["Train/Samples/lr"]
    got = read_scalars(tmp_path / "tb" / "run1")
    assert [s for s, _ in got["Train/Samples/train_loss"]] == [0, 8]


def test_non_zero_rank_writes_nothing(tmp_path):
    cfg = {"enabled": True, "output_path": str(tmp_path / "out"), "job_name": "j"}
    with MonitorMaster(csv=cfg, tensorboard=cfg, rank=1) as master:
        assert not master.enabled
        master.write_events(EVENTS[0])
    assert list(tmp_path.iterdir()) == []


def test_disabled_or_missing_blocks_build_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    master = MonitorMaster(csv={"enabled": False}, tensorboard=None, rank=0)
    assert not master.enabled
    master.write_events(EVENTS[0])
    master.close()
    assert list(tmp_path.iterdir()) == []


def test_empty_output_path_uses_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with MonitorMaster(
        csv={"enabled": True, "output_path": "", "job_name": "a"},
        tensorboard={"enabled": True, "output_path": "", "job_name": "b"},
    ) as master:
        master.write_events([("x", 1.0, 0)])
    assert (tmp_path / "csv_monitor" / "a" / "x.csv").is_file()
    assert read_scalars(tmp_path / "runs" / "b") == {"x": [(0, 1.0)]}


@pytest.mark.parametrize("which", ["csv", "tensorboard"])
def test_file_where_directory_should_be(tmp_path, which):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    cfg = {"enabled": True, "output_path": str(blocker), "job_name": "j"}
    with pytest.raises(NotADirectoryError) as info:
        MonitorMaster(**{which: cfg})
    assert info.value.errno == errno.ENOTDIR
    assert str(blocker / "j") in str(info.value)
    assert f"{which} monitor" in str(info.value)


def test_job_dir_is_a_file(tmp_path):
    (tmp_path / "j").write_text("")
    with pytest.raises(FileExistsError, match=str(tmp_path / "j")):
        CSVMonitor(tmp_path, "j")


def test_a_failing_monitor_fails_the_master(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    ok = {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}
    bad = {"enabled": True, "output_path": str(blocker), "job_name": "j"}
    with pytest.raises(OSError, match="tensorboard monitor"):
        MonitorMaster(csv=ok, tensorboard=bad)


def test_unknown_config_keys_and_bad_enabled():
    with pytest.raises(ValueError, match=r"`csv_monitor` config has unknown keys \['outputpath'\]"):
        MonitorMaster(csv={"enabled": True, "outputpath": "x"}, rank=1)
    with pytest.raises(ValueError, match=r"`tensorboard.enabled` must be true or false, got 'yes'"):
        MonitorMaster(tensorboard={"enabled": "yes"})


def test_missing_tensorboard_says_how_to_install(tmp_path, monkeypatch):
    # A None entry in sys.modules makes the import raise ImportError.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r'pip install "zcore\[tensorboard\]"'):
        TensorBoardMonitor(tmp_path, "j")
    assert not (tmp_path / "j").exists()
