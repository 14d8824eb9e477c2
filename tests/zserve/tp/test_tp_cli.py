"""`z serve MODEL --tp N` as a user runs it (the tiny random LLaMA with SmolLM2's tokenizer, 4
query / 2 KV heads): a --tp beyond the query heads, a bad --tp-collectives or a bad --cpu-idle
fails at start naming the numbers, and a rank killed under a running server ends the `z serve` process with an
error naming the rank."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.utils.cli import Z, run_z
from tests.utils.tiny_lm import write_tiny_lm
from zcore.process import free_port


def test_tp_beyond_query_heads_fails_at_start(tmp_path: Path) -> None:
    model = write_tiny_lm(tmp_path / "lm")
    done = run_z("serve", str(model), "--tp", "5", ok=False, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "tp 5 > num_attention_heads 4" in done.stderr and "--tp 4" in done.stderr


def test_bad_tp_collectives_fail_at_start(tmp_path: Path) -> None:
    model = write_tiny_lm(tmp_path / "lm")
    done = run_z("serve", str(model), "--tp", "2", "--tp-collectives", "mpi", ok=False)
    assert done.returncode == 2, done.stderr
    assert "--tp-collectives 'mpi'" in done.stderr and "`p2p`" in done.stderr, done.stderr
    done = run_z("serve", str(model), "--tp-collectives", "gloo", ok=False)
    assert done.returncode == 2, done.stderr
    assert "--tp is 1" in done.stderr and "--tp N" in done.stderr, done.stderr


def test_bad_cpu_idle_fails_at_start(tmp_path: Path) -> None:
    model = write_tiny_lm(tmp_path / "lm")
    done = run_z("serve", str(model), "--tp", "2", "--cpu-idle", "spin", ok=False)
    assert done.returncode == 2, done.stderr
    assert "cpu_idle" in done.stderr and "'auto', 'poll' or 'halt'" in done.stderr, done.stderr


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(c) for c in text.split()]


@pytest.mark.slow(reason="a z serve process and its rank: ~15 s; test_tp_server is the fast check")
def test_killed_rank_ends_z_serve_naming_it(tmp_path: Path) -> None:
    model = write_tiny_lm(tmp_path / "lm")
    port = free_port()
    args = [str(Z), "serve", str(model), "--tp", "2", "--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, server.stderr
            time.sleep(0.2)
        # rank 1: the child started by multiprocessing's spawn (not its resource tracker)
        (rank1,) = [c for c in _children(server.pid) if "spawn_main" in _cmdline(c)]
        os.kill(rank1, signal.SIGKILL)
        body = {"model": "lm", "prompt": "To be", "max_tokens": 8}
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        assert resp.status_code in (500, 503), resp.text
        _, err = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode != 0
    assert "rank 1 (exit code -9) died" in err, err[-2000:]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


@pytest.mark.slow(reason="two replicas of two ranks each: 4 processes, ~140 s on 2 loaded cores")
def test_replicas_of_tp_engines_serve_greedy_equal(tmp_path: Path) -> None:
    """`z serve --tp 2 --replicas 2`: each replica is rank 0 of its own two ranks; requests
    spread over both give one process's greedy text."""
    import zserve

    model = write_tiny_lm(tmp_path / "lm")
    prompts = ["To be, or not to be", "Once more unto the breach", "Friends, Romans", "O Romeo"]
    with zserve.pipeline(model, max_model_len=128) as one:
        want = [c.text for c in one(prompts, max_tokens=6, temperature=0)]
    port = free_port()
    args = [str(Z), "serve", str(model), "--tp", "2", "--replicas", "2", "--port", str(port)]
    args += ["--max-model-len", "128", "--log-level", "warning"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:  # own session: teardown signals the front end and its ranks
        server = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.25)
        got = []
        for p in prompts * 2:
            body = {"model": "lm", "prompt": p, "max_tokens": 6, "temperature": 0}
            resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            got.append(resp.json()["choices"][0]["text"])
        replicas = httpx.get(f"{url}/health", timeout=10).json()["replicas"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert got == want * 2
    assert all(r["routed"] > 0 for r in replicas), replicas
