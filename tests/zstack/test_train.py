"""`z train`, `z generate`, `z checkpoint consolidate` end to end on the `tiny` GPT.

One real 2-rank run through the launcher (a subprocess, as a user starts it) is shared by
the module; commands that need no ranks run in-process through Typer's runner.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.utils.processes import alive, children, still_alive_after
from zstack.cli import app
from zstack.launch import RANK_ENTRY
from ztrain.gpt import GPT, GPTConfig
from ztrain.metrics import read_jsonl
from ztrain.run_lock import hold_run_dir

# About 60 s in all on a quiet 2-core machine: the xdist workers start this file first.
pytestmark = pytest.mark.heavy(60)

Z = Path(sys.executable).parent / "z"
TINY = ["--preset", "tiny", "--seq-len", "64", "--micro-batch", "4", "--eval-every", "3"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer and token caches shared by the module's runs."""
    return tmp_path_factory.mktemp("zstack-cache")


@pytest.fixture(autouse=True)
def _cache_env(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The module's cache (one torch thread is set suite-wide: tests/conftest.py)."""
    monkeypatch.setenv("ZSTACK_CACHE", str(cache))
    yield


def z_train(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Z), "train", *args], capture_output=True, text=True, timeout=timeout, env=os.environ
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    """A finished 6-step, 2-rank ZeRO-3 run of the tiny GPT, saved at steps 3 and 6."""
    out = tmp_path_factory.mktemp("run") / "tiny"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZSTACK_CACHE", str(cache))
        args = ["--nproc", "2", "--steps", "6", "--save-every", "3", *TINY]
        done = z_train(*args, "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "val loss" in done.stdout and "done: steps 0 -> 6" in done.stdout, done.stdout
    return out


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def test_train_writes_metrics_plot_checkpoint_and_export(run: Path) -> None:
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    assert records[0] == {"step": 0, "val_loss": pytest.approx(records[0]["val_loss"])}
    assert abs(records[0]["val_loss"] - torch.log(torch.tensor(2048.0)).item()) < 0.3
    for r in records[1:]:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "rank_rss_mib", "elapsed_s"} <= set(r)
        assert len(r["rank_rss_mib"]) == 2 and min(r["rank_rss_mib"]) > 10
    assert [r["step"] for r in records if "val_loss" in r] == [0, 3, 6]
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    assert (run / "loss.png").read_bytes()[:8] == PNG_MAGIC
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step6"
    assert {p.name for p in (run / "export").iterdir()} == {
        "model.json",
        "model.safetensors",
        "tokenizer.json",
    }


def test_resume_continues_the_step_count(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    shutil.copytree(run, out)
    # One rank, in this process (no launcher): the 2-rank checkpoint loads on any world size.
    code, text = invoke(
        "train", "--nproc", "1", "--resume", "--steps", "9", *TINY, "--out", str(out)
    )
    assert code == 0, text
    assert "steps 6 -> 9" in text
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 10))
    assert [r["step"] for r in records if "val_loss" in r] == [0, 3, 6, 9]
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step9"


def test_resume_over_an_incomplete_latest_continues_from_the_previous(
    run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "resumed"
    shutil.copytree(run, out)
    (out / "checkpoints" / "global_step6" / "rank_00001.pt").unlink()
    code, text = invoke(
        "train", "--nproc", "1", "--resume", "--steps", "7", *TINY, "--out", str(out)
    )
    assert code == 0, text
    assert "warning: checkpoint `global_step6`" in text, text
    assert "is incomplete: no rank_00001.pt; resuming from `global_step3` (step 3)" in text
    assert "steps 3 -> 7" in text
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 8))
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step7"


def test_resume_with_no_complete_checkpoint_exits_2(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    shutil.copytree(run, out)
    for tag in ("global_step3", "global_step6"):
        (out / "checkpoints" / tag / "manifest.json").unlink()
    code, text = invoke(
        "train", "--nproc", "1", "--resume", "--steps", "9", *TINY, "--out", str(out)
    )
    assert code == 2, text
    assert "`global_step6`" in text and "no manifest.json" in text
    assert "no complete checkpoint" in text and "without `--resume`" in text


def test_generate_from_run_export_and_checkpoint(run: Path) -> None:
    code, text = invoke(
        "generate", "--checkpoint", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "12"
    )
    assert code == 0, text
    assert text.startswith("ROMEO:") and len(text) > len("ROMEO:\n")
    # Greedy decoding: the consolidated sharded checkpoint is the exported model.
    greedy = ["--prompt", "JULIET:", "--max-new-tokens", "8", "--temperature", "0"]
    outputs = {
        where: invoke("generate", "--checkpoint", str(where), *greedy)
        for where in (run / "export", run / "checkpoints", run / "checkpoints" / "global_step6")
    }
    assert all(code == 0 for code, _ in outputs.values()), outputs
    assert len({text for _, text in outputs.values()}) == 1, outputs


def test_generate_names_what_is_missing(tmp_path: Path) -> None:
    code, text = invoke("generate", "--checkpoint", str(tmp_path), "--prompt", "x")
    assert code == 2
    assert str(tmp_path) in text and "--out" in text


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_consolidate_loads_strictly(run: Path, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"model{suffix}"
    code, text = invoke("checkpoint", "consolidate", str(run / "checkpoints"), str(out))
    assert code == 0, text
    assert str(out) in text and "parameters" in text
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(out)
    else:
        state = torch.load(out, weights_only=True)
    config = GPTConfig.from_dict(json.loads((run / "export" / "model.json").read_text()))
    model = GPT(config)
    model.load_state_dict(state, strict=True)
    assert model.transformer.wte.weight is model.lm_head.weight
    from safetensors.torch import load_file

    exported = load_file(run / "export" / "model.safetensors")
    for name, value in exported.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stgae": 3}}))
    code, text = invoke("train", "--config", str(config), "--out", str(tmp_path / "run"))
    assert code == 2, text
    assert "stgae" in text and "Traceback" not in text


def test_config_keys_win_over_flags(tmp_path: Path) -> None:
    from ztrain.train_config import build_config
    from ztrain.train_options import TrainOptions

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 32, "optimizer": {"type": "SGD"}}))
    opts = TrainOptions(config=config, micro_batch=4, lr=0.5, explicit=frozenset({"micro_batch"}))
    rc = build_config(opts, world_size=2)
    assert rc.config.batch_sizes(2).micro_batch_size == 16
    assert rc.config.optimizer.type == "SGD"
    assert rc.config.zero_optimization.stage == 3  # not in the file: from the flags
    assert len(rc.notes) == 1 and "--micro-batch 4" in rc.notes[0]  # --lr was not given


def test_resume_without_checkpoint_exits_2(tmp_path: Path) -> None:
    code, text = invoke("train", "--resume", "--out", str(tmp_path / "none"))
    assert code == 2
    assert str(tmp_path / "none" / "checkpoints") in text and "without `--resume`" in text


@pytest.mark.slow
def test_resumed_run_matches_the_uninterrupted_one(tmp_path: Path) -> None:
    full = tmp_path / "full"
    done = z_train("--nproc", "2", "--steps", "6", "--save-every", "3", *TINY, "--out", str(full))
    assert done.returncode == 0, done.stdout + done.stderr
    part = tmp_path / "part"
    shutil.copytree(full, part)
    (part / "checkpoints" / "latest").write_text("global_step3")
    done = z_train("--nproc", "2", "--resume", "--steps", "6", *TINY, "--out", str(part))
    assert done.returncode == 0, done.stdout + done.stderr
    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
    assert [r["step"] for r in b if "loss" in r] == list(range(1, 7))
    for key in ("loss", "lr", "grad_norm"):
        assert [r[key] for r in a if "loss" in r] == pytest.approx(
            [r[key] for r in b if "loss" in r], rel=1e-5
        ), key


def _ranks_of(launcher: int) -> list[int]:
    ranks = []
    for pid in children(launcher):
        try:
            if RANK_ENTRY in Path(f"/proc/{pid}/cmdline").read_text():
                ranks.append(pid)
        except FileNotFoundError:
            pass
    return ranks


def _training(out: Path, launcher: subprocess.Popen[str], timeout: float = 180) -> None:
    """Wait until the run in `out` has written its first step."""
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + timeout
    while not (metrics.is_file() and any("loss" in r for r in read_jsonl(metrics))):
        if launcher.poll() is not None:
            pytest.fail(f"`z train` exited ({launcher.returncode}):\n{launcher.communicate()}")
        assert time.monotonic() < deadline, f"no step in `{metrics}` after {timeout} s"
        time.sleep(0.2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_live_run_holds_its_dir_and_its_ranks_die_with_its_launcher(tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [str(Z), "train", "--nproc", "2", "--steps", "1000", *TINY, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    try:
        _training(out, launcher)
        ranks = _ranks_of(launcher.pid)
        assert len(ranks) == 2 and all(alive(pid) for pid in ranks), ranks
        # A second run on the directory fails at start, naming the live one.
        second = z_train("--nproc", "2", "--steps", "2", *TINY, "--out", str(out))
        assert second.returncode == 2, second.stdout + second.stderr
        holder = f"pid {launcher.pid} on host {socket.gethostname()}"
        assert f"`{out}` is in use by {holder}" in second.stderr, second.stderr
        assert "--out" in second.stderr and "Traceback" not in second.stderr
    finally:
        launcher.send_signal(signal.SIGKILL)  # the launcher process alone, not its group
        launcher.communicate(timeout=10)
    assert still_alive_after(ranks, 10) == []
    # The dead run's lock (file and holder text left behind) does not block the next one.
    with hold_run_dir(out) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
