"""`z serve --replicas 2` as a user starts it: a subprocess running the real CLI, two engine
processes behind the least-loaded router. Load spreads over both; SIGKILL one worker and the
requests it held fail cleanly (502 / an SSE error event naming it) while the rest, and every
later request, are served by the survivor. Each worker runs on its own slice of the cores."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.utils.models import smollm2_dir
from tests.zserve.server.conftest import shakespeare_prompts
from zcore.process import free_port
from zserve.server.prometheus import parse_prometheus
from zserve.server.replicas import replica_cpus

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("zserve") / "serve.log"
    z = Path(sys.executable).parent / "z"
    cmd = [
        str(z),
        "serve",
        str(smollm2_dir()),
        "--port",
        str(port),
        "--replicas",
        "2",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "64",
        "--log-level",
        "warning",
    ]
    with open(log, "wb") as out:
        # own session: teardown signals the front end and its workers as one group
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"`z serve` exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"`z serve --replicas 2` not up in 240 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _replicas(url: str) -> list[dict]:
    return httpx.get(f"{url}/health", timeout=10).json()["replicas"]


def _cores(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


def test_each_replica_runs_on_its_own_cores(front: str) -> None:
    reps = _replicas(front)
    want = replica_cpus(2)
    if want is None:
        pytest.skip("fewer cores than replicas: every replica runs on every core")
    got = [_cores(r["pid"]) for r in reps]
    assert got == [set(c) for c in want] and not got[0] & got[1], got


def test_replica_cpus_cut_the_allowed_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 9})
    assert replica_cpus(3) == [[0, 1], [2, 3, 4], [5, 6, 9]]
    assert replica_cpus(1) == [[0, 1, 2, 3, 4, 5, 6, 9]]
    assert replica_cpus(9) is None  # fewer cores than replicas: not pinned


def test_load_spreads_over_both_replicas(front: str) -> None:
    reps = _replicas(front)
    assert [r["healthy"] for r in reps] == [True, True]
    assert len({r["pid"] for r in reps}) == 2
    prompts = shakespeare_prompts(16, start=300, words=5)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=front, timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v1/completions",
                        json={"model": MODEL, "prompt": p, "max_tokens": 4, "temperature": 0},
                    )
                    for p in prompts
                )
            )

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 16
    by_replica = [r.headers["x-zserve-replica"] for r in responses]
    assert by_replica.count("0") >= 4 and by_replica.count("1") >= 4, by_replica
    # each worker's own count agrees with the router's choice
    for rep in _replicas(front):
        worker = parse_prometheus(httpx.get(f"{rep['url']}/metrics").text)
        assert worker['zserve_requests_total{outcome="completed"}'] == by_replica.count(
            str(rep["index"])
        )
    # a stream relays through the router intact
    body = {"model": MODEL, "prompt": prompts[0], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{front}/v1/completions", json=body, timeout=60) as resp:
        events = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    models = httpx.get(f"{front}/v1/models").json()
    assert models["data"][0]["id"] == MODEL


def _workers_idle(front: str, timeout_s: float = 30.0) -> list[dict]:
    """Each worker's /health once nothing runs there and all its KV blocks are free."""
    deadline = time.monotonic() + timeout_s
    while True:
        healths = [httpx.get(f"{r['url']}/health", timeout=10).json() for r in _replicas(front)]
        if all(h["num_running"] == 0 and h["free_blocks"] == h["total_blocks"] for h in healths):
            return healths
        if time.monotonic() > deadline:
            return healths
        time.sleep(0.05)


def _worker_outcomes(front: str) -> dict[str, float]:
    total = {"completed": 0.0, "aborted": 0.0}
    for rep in _replicas(front):
        worker = parse_prometheus(httpx.get(f"{rep['url']}/metrics").text)
        for k in total:
            total[k] += worker.get(f'zserve_requests_total{{outcome="{k}"}}', 0.0)
    return total


def test_client_disconnect_through_the_router_frees_kv_blocks(front: str) -> None:
    before = _worker_outcomes(front)
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", f"{front}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        lines = resp.iter_lines()
        assert sum(next(lines).startswith("data: {") for _ in range(6)) >= 3
        held = [httpx.get(f"{r['url']}/health").json() for r in _replicas(front)]
        assert any(h["free_blocks"] < h["total_blocks"] for h in held)
    for h in _workers_idle(front):
        assert h["free_blocks"] == h["total_blocks"] and h["num_running"] == 0, h
    # a client that gives up on a whole completion: the router cancels its upstream request
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{front}/v1/completions", json=body, timeout=1.5)
    for h in _workers_idle(front):
        assert h["free_blocks"] == h["total_blocks"] and h["num_running"] == 0, h
    # both were aborted by the workers (not run to their 200 tokens)
    after = _worker_outcomes(front)
    assert after["aborted"] - before["aborted"] == 2
    assert after["completed"] == before["completed"]


def test_survives_a_killed_replica(front: str) -> None:
    victim = _replicas(front)[1]
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    prompts = shakespeare_prompts(8, start=400, words=5)

    async def stream(client: httpx.AsyncClient, prompt: str) -> tuple[int, str, list[str]]:
        async with client.stream(
            "POST", "/v1/completions", json={**body, "prompt": prompt, "stream": True}
        ) as resp:
            if resp.status_code != 200:  # the replica died before its first byte
                return resp.status_code, "", [(await resp.aread()).decode()]
            lines = [ln async for ln in resp.aiter_lines() if ln.startswith("data: ")]
            return 200, resp.headers["x-zserve-replica"], lines

    async def main() -> list:
        async with httpx.AsyncClient(base_url=front, timeout=120) as client:
            tasks = [
                asyncio.ensure_future(client.post("/v1/completions", json={**body, "prompt": p}))
                for p in prompts[:6]
            ] + [asyncio.ensure_future(stream(client, p)) for p in prompts[6:]]
            # kill the worker only once both replicas hold requests
            deadline = time.monotonic() + 60
            while not all(
                r["in_flight"] > 0 for r in (await client.get("/health")).json()["replicas"]
            ):
                assert time.monotonic() < deadline, "requests never reached both replicas"
                await asyncio.sleep(0.05)
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    posts, streams = results[:6], results[6:]
    codes = [r.status_code for r in posts]
    assert set(codes) <= {200, 502}, codes
    failed = [r.json()["error"] for r in posts if r.status_code == 502]
    served = [r for r in posts if r.status_code == 200]
    assert failed and served, codes
    for err in failed:
        assert err["code"] == "replica_failed" and err["type"] == "server_error"
        assert f"replica 1 (pid {victim['pid']}" in err["message"], err["message"]
    assert all(r.headers["x-zserve-replica"] == "0" for r in served)
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in served)
    for status, replica, lines in streams:
        if status == 502:
            err = json.loads(lines[0])["error"]
        elif replica == "0":
            assert lines[-1] == "data: [DONE]"
            continue
        else:  # cut off mid-stream: an error event naming the replica, no [DONE]
            err = json.loads(lines[-1][len("data: ") :])["error"]
        assert err["code"] == "replica_failed" and "replica 1" in err["message"], err

    # everything after the kill goes to the survivor
    for p in prompts[:4]:
        resp = httpx.post(
            f"{front}/v1/completions", json={**body, "prompt": p, "max_tokens": 2}, timeout=60
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-zserve-replica"] == "0"
    health = httpx.get(f"{front}/health").json()
    assert health["status"] == "ok" and health["live_replicas"] == 1
    dead = health["replicas"][1]
    assert dead["alive"] is False and dead["healthy"] is False
    router = parse_prometheus(httpx.get(f"{front}/metrics").text)
    assert router['zserve_router_replica_up{replica="1"}'] == 0
    assert router['zserve_router_failures_total{replica="1"}'] >= len(failed)
