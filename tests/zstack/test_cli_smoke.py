"""Smoke test of every `z` command: each one really runs, as a user starts it (the `z`
console script in a subprocess), on tiny sizes, and its output is checked.

The commands come from the Typer app itself (`z`, `z bench`, `z checkpoint`, ...), and
`test_every_command_has_a_smoke_case` fails for a command without a case in `CASES`, so a
new command cannot land without one (nor can a case outlive its command).

The module fixture starts the cases in a pool (`WORKERS`), longest first, and each test waits
for its own; cases that need another's output (`z generate` after `z train`) run after it. The
deeper behaviour of each command is tested in its own file (test_train.py,
test_bench_*.py, test_quant_cli.py, ...); this file proves that each one starts, runs and
prints what it promises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from tests.utils.tiny_lm import write_tiny_lm

# About 300 s in all on a quiet 2-core machine: the xdist workers start this file first.
pytestmark = pytest.mark.heavy(300)

Z = Path(sys.executable).parent / "z"
# One case at a time: `make test` runs another test file on the other xdist worker, and cases
# run side by side only slowed each other past the per-test budget.
WORKERS = 1
TIMEOUT_S = 270.0  # one command on a busy machine (under pytest-timeout's 300 s per test)


def app_commands() -> list[str]:
    """Every runnable `z` command, as typed after `z` (`doctor`, `bench adam`, ...)."""
    import typer.main

    from zstack.cli import app

    def walk(group: Any, prefix: str) -> Iterator[str]:
        for name, command in group.commands.items():
            if hasattr(command, "commands"):  # a group: `z bench`, `z checkpoint`
                yield from walk(command, f"{prefix}{name} ")
            else:
                yield f"{prefix}{name}"

    return list(walk(typer.main.get_command(app), ""))


# ---------------------------------------------------------------------------- running


_EXEC_WITH_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


@dataclass
class Work:
    """What the cases share: a scratch directory, the tiny model, the subprocess env."""

    dir: Path
    lm: Path
    env: dict[str, str]
    live: set[subprocess.Popen[str]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, *args: str, stdout: int = subprocess.PIPE) -> subprocess.Popen[str]:
        """`z ARGS` in the background, with Ctrl+C (SIGINT) at its default disposition as in a
        terminal: a runner that ignores SIGINT would pass that on and hide how `z` exits on it."""
        proc = subprocess.Popen(
            [sys.executable, "-c", _EXEC_WITH_DEFAULT_SIGINT, str(Z), *args],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
            cwd=self.dir,
        )
        with self.lock:
            self.live.add(proc)
        return proc

    def z(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`z ARGS` to completion (killed after TIMEOUT_S)."""
        proc = self.start(*args)
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(
                f"`z {' '.join(args)}` ran past {TIMEOUT_S} s:\n{err[-3000:]}"
            ) from None
        finally:
            with self.lock:
                self.live.discard(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def ok(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`z ARGS`, which must exit 0."""
        done = self.z(*args)
        assert done.returncode == 0, (
            f"`z {' '.join(args)}` exited {done.returncode}:\n{done.stdout[-2000:]}\n"
            f"{done.stderr[-3000:]}"
        )
        return done

    def json(self, *args: str) -> dict[str, Any]:
        """The JSON object `z ARGS` prints last."""
        done = self.ok(*args)
        return json.loads(done.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Case:
    run: Callable[[Work], None]  # runs the command and asserts on what it did
    after: str | None = None  # the case whose output this one reads


CASES: dict[str, Case] = {}


def smoke(command: str, after: str | None = None) -> Callable[[Callable[[Work], None]], Any]:
    """Register the smoke case of `z COMMAND` (registration order: longest first)."""

    def add(fn: Callable[[Work], None]) -> Callable[[Work], None]:
        assert command not in CASES, f"two smoke cases for `z {command}`"
        CASES[command] = Case(fn, after)
        return fn

    return add


# ---------------------------------------------------------------------------- cases


@smoke("train")
def _train(w: Work) -> None:
    run = w.dir / "run"
    done = w.ok(
        "train",
        "--nproc",
        "1",
        "--steps",
        "1",
        "--preset",
        "tiny",
        "--seq-len",
        "16",
        "--micro-batch",
        "1",
        "--vocab-size",
        "257",
        "--eval-every",
        "1",
        "--out",
        str(run),
    )
    assert "done: steps 0 -> 1" in done.stdout, done.stdout
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step1"
    assert (run / "export" / "model.safetensors").is_file()
    metrics = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [0, 1]


@smoke("export-mixtral")
def _export_mixtral(w: Work) -> None:
    run, out = w.dir / "moe-run", w.dir / "mixtral"
    w.ok(
        "train",
        "--nproc",
        "1",
        "--steps",
        "1",
        "--preset",
        "tiny",
        "--seq-len",
        "16",
        "--micro-batch",
        "1",
        "--vocab-size",
        "257",
        "--eval-every",
        "1",
        "--moe",
        "--moe-experts",
        "2",
        "--moe-dropless",
        "--out",
        str(run),
    )
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"aux_loss", "dropped_fraction", "expert_load"} <= metrics[-1].keys()
    done = w.ok("export-mixtral", str(run), str(out))
    assert f"wrote `{out}`: Mixtral, 4 layers x 2 experts, top-2" in done.stdout, done.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 2
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "model.layers.3.block_sparse_moe.experts.1.w3.weight" in f.keys()


@smoke("generate", after="train")
def _generate(w: Work) -> None:
    done = w.ok(
        "generate",
        "--checkpoint",
        str(w.dir / "run"),
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0",
    )
    assert done.stdout.startswith("ROMEO:") and len(done.stdout.strip()) > len("ROMEO:")


@smoke("checkpoint consolidate", after="train")
def _consolidate(w: Work) -> None:
    out = w.dir / "model.safetensors"
    done = w.ok("checkpoint", "consolidate", str(w.dir / "run" / "checkpoints"), str(out))
    assert f"wrote `{out}`" in done.stdout
    with safe_open(str(out), framework="pt") as f:
        assert "lm_head.weight" in f.keys() and f.get_tensor("lm_head.weight").ndim == 2


import tests.zstack.smoke_cases_cp  # noqa: E402  (registers `z bench cp`)
import tests.zstack.smoke_cases_finetune  # noqa: E402  (registers `z finetune`)
import tests.zstack.smoke_cases_pipe  # noqa: E402  (registers `z bench pipe`)
import tests.zstack.smoke_cases_tools  # noqa: E402  (registers the bench, serve, ... cases)
import tests.zstack.smoke_cases_tp  # noqa: E402  (registers `z bench tp`)
import tests.zstack.test_cli_smoke_chat  # noqa: E402, F401  (registers the `z chat` cases)


@smoke("estimate-memory")
def _estimate_memory(w: Work) -> None:
    r = w.json("estimate-memory", "--params", "1M", "--world-size", "2", "--stage", "3", "--json")
    # stage 3 on 2 ranks: 2 B params + 2 B grads + 12 B Adam state per parameter, halved
    assert (r["params"], r["grads"], r["optimizer"], r["total"]) == (
        10**6,
        10**6,
        6 * 10**6,
        8 * 10**6,
    )


# ---------------------------------------------------------------------------- fixtures


def _order() -> list[str]:
    """The cases in the order they start: those that need no other's output first."""
    return [c for c in CASES if CASES[c].after is None] + [c for c in CASES if CASES[c].after]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[float]]]:
    """Every case started: command -> future of its seconds (raising what the case raised)."""
    root = tmp_path_factory.mktemp("smoke")
    env = dict(os.environ, ZSTACK_CACHE=str(root / "cache"), OMP_NUM_THREADS="1")
    work = Work(root, write_tiny_lm(root / "tiny-llama"), env)
    done: dict[str, Future[float]] = {c: Future() for c in CASES}

    def run(command: str) -> None:
        t0 = time.perf_counter()
        try:
            CASES[command].run(work)
        except BaseException as exc:  # handed to the command's test
            done[command].set_exception(exc)
            skip(command)
        else:
            done[command].set_result(time.perf_counter() - t0)
            for next_ in (c for c in CASES if CASES[c].after == command):
                pool.submit(run, next_)  # its input is there now

    def skip(failed: str) -> None:
        for next_ in (c for c in CASES if CASES[c].after == failed):
            done[next_].set_exception(AssertionError(f"not run: `z {failed}` failed first"))
            skip(next_)

    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="smoke")
    for command in _order():
        if CASES[command].after is None:
            pool.submit(run, command)
    yield done
    pool.shutdown(wait=False, cancel_futures=True)
    with work.lock:
        for proc in work.live:  # only after a failure stopped the module early
            proc.kill()
    pool.shutdown(wait=True)


# ---------------------------------------------------------------------------- tests


def test_every_command_has_a_smoke_case() -> None:
    commands = app_commands()
    missing = [c for c in commands if c not in CASES]
    assert not missing, (
        f"no smoke case for {', '.join(f'`z {c}`' for c in missing)}; add one to CASES in "
        f"{Path(__file__).name} (`@smoke(...)`: tiny sizes, a few seconds)"
    )
    stale = sorted(set(CASES) - set(commands))
    assert not stale, f"smoke cases for commands `z` no longer has: {stale}; remove them"
    assert {c.after for c in CASES.values()} - {None} <= set(CASES)


def test_cli_import_loads_no_heavy_package() -> None:
    """`z --help` stays fast: command modules import torch & co. inside their bodies."""
    code = (
        "import sys, zstack.cli\n"
        "heavy = ('torch', 'numpy', 'transformers', 'znative', 'zcore', 'zserve', 'zquant')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# Cases in the order they start (so each test mostly waits for its own), then any command
# without one (which fails, naming it).
@pytest.mark.parametrize(
    "command",
    [c for c in _order() if c in app_commands()] + sorted(set(app_commands()) - set(CASES)),
)
def test_command_runs(command: str, runs: dict[str, Future[float]]) -> None:
    if command not in runs:
        pytest.fail(f"`z {command}` has no smoke case; add one to CASES in {Path(__file__).name}")
    runs[command].result()  # re-raises the case's assertion, with the command's output
