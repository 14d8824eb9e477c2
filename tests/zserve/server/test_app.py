"""The OpenAI-compatible server of one engine, over real HTTP on loopback with SmolLM2:
bad requests, parity with the engine, chat template, SSE streaming, concurrency, queue
bound, disconnect and the KV allocator's free-block count after many requests."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.zserve.server.conftest import MAX_MODEL_LEN, LiveServer, shakespeare_prompts
from zserve.sampling import SamplingParams
from zserve.server.prometheus import parse_prometheus

# About 100 s in all on a quiet 2-core machine: the xdist workers start this file first.
pytestmark = pytest.mark.heavy(100)

MODEL = "SmolLM2-135M-Instruct"


def _run_engine(engine, prompts: list[str | list[int]], params: SamplingParams) -> list[dict]:
    """Drive ``engine`` directly (all prompts at once) and gather each request's result."""
    results = {f"r{i}": {"text": "", "tokens": []} for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        for out in engine.step():
            r = results[out.request_id]
            r["text"] += out.text
            r["tokens"] += out.token_ids
            if out.finished:
                r["finish_reason"] = out.finish_reason
    return [results[f"r{i}"] for i in range(len(prompts))]


def _sse_events(lines: list[str]) -> list[str]:
    return [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]


# (endpoint, raw body, status, param the error must name, words its message must contain)
LONG_PROMPT = "To be, or not to be, that is the question. " * 60  # ~660 tokens > 512
BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "m", "prompt": "hi", ', 400, None, "malformed JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "valid dictionary"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": "4"},
        400,
        "max_tokens",
        "'4'",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": 42}, 400, "prompt", "42"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "temperature": "hot"},
        400,
        "temperature",
        "hot",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream", "yes"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "gpt-4"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "0"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": -5},
        400,
        "max_tokens",
        "-5",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": LONG_PROMPT},
        400,
        "prompt",
        f"{MAX_MODEL_LEN} tokens",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 600},
        400,
        "max_tokens",
        "600",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999999]}, 400, "prompt", "99999999"),
    # torch's generators take no seed wider than 64 bits
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "seed": 2**64},
        400,
        "seed",
        str(2**63 - 1),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "seed": -(2**63) - 1},
        400,
        "seed",
        str(-(2**63)),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": 7}]},
        400,
        "messages.0.content",
        "7",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", "'hi'"),
    (
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        404,
        "model",
        "nope",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]},
        400,
        "messages",
        "context",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
        400,
        "max_tokens",
        "0",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), BAD_REQUESTS)
def test_bad_requests_get_4xx_naming_the_field(
    live_server: LiveServer, path: str, body: object, status: int, param: str | None, words: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(
        live_server.url + path, content=content, headers={"content-type": "application/json"}
    )
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert words in err["message"], err["message"]
    if param is not None:
        assert param in err["message"], err["message"]


def test_models_and_health(live_server: LiveServer) -> None:
    models = httpx.get(f"{live_server.url}/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, MAX_MODEL_LEN)]
    health = live_server.health()
    assert health["status"] == "ok" and health["model"] == MODEL
    assert health["total_blocks"] == live_server.engine.stats()["total_blocks"] > 0


def test_greedy_completions_equal_the_engine(live_server: LiveServer, reference_engine) -> None:
    prompts = shakespeare_prompts(4)
    want = _run_engine(reference_engine, prompts, SamplingParams(max_tokens=8, temperature=0))

    async def ask(client: httpx.AsyncClient, prompt: str) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    async def main() -> list[dict]:
        async with httpx.AsyncClient(base_url=live_server.url, timeout=60) as client:
            return await asyncio.gather(*(ask(client, p) for p in prompts))

    got = asyncio.run(main())
    for prompt, g, w in zip(prompts, got, want, strict=True):
        choice = g["choices"][0]
        assert choice["text"] == w["text"], prompt
        assert choice["finish_reason"] == w["finish_reason"]
        n_prompt = len(reference_engine.tokenizer.encode(prompt))
        assert g["usage"] == {
            "prompt_tokens": n_prompt,
            "completion_tokens": len(w["tokens"]),
            "total_tokens": n_prompt + len(w["tokens"]),
        }
    # token ids as the prompt give the same answer as the text they encode
    ids = reference_engine.tokenizer.encode(prompts[0])
    body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0}
    resp = httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=60)
    assert resp.json()["choices"][0]["text"] == want[0]["text"]


def test_tiny_temperature_is_greedy_and_fails_no_other_request(live_server: LiveServer) -> None:
    # logits / 1e-45 overflow to inf, softmax gives NaN: before, the engine step failed and
    # took every request in flight with it
    prompts = shakespeare_prompts(2, start=60)

    async def ask(client: httpx.AsyncClient, prompt: str, temperature: float) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": temperature}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]

    async def main() -> list[dict]:
        async with httpx.AsyncClient(base_url=live_server.url, timeout=60) as client:
            return await asyncio.gather(
                ask(client, prompts[0], 1e-45),
                ask(client, prompts[1], 0.8),
                ask(client, prompts[0], 0.0),
            )

    tiny, other, greedy = asyncio.run(main())
    assert tiny == greedy
    assert other["finish_reason"] in ("stop", "length")


def test_chat_uses_the_models_template(live_server: LiveServer, reference_engine) -> None:
    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Who wrote Hamlet?"},
    ]
    templated = reference_engine.tokenizer.apply_chat_template(messages)
    assert templated.endswith("<|im_start|>assistant\n")
    (want,) = _run_engine(
        reference_engine, [templated], SamplingParams(max_tokens=10, temperature=0)
    )
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0}
    resp = httpx.post(f"{live_server.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == {"role": "assistant", "content": want["text"]}
    assert got["usage"]["prompt_tokens"] == len(reference_engine.tokenizer.encode(templated))


def test_sse_streaming_is_incremental_and_ends_with_done(live_server: LiveServer) -> None:
    prompt = shakespeare_prompts(1, start=40)[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
    whole = httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=60).json()
    with httpx.stream(
        "POST", f"{live_server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(list(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 3, chunks  # incremental, not one blob
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])

    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    whole = httpx.post(f"{live_server.url}/v1/chat/completions", json=chat, timeout=60).json()
    with httpx.stream(
        "POST", f"{live_server.url}/v1/chat/completions", json={**chat, "stream": True}, timeout=60
    ) as resp:
        events = _sse_events(list(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]


def test_200_concurrent_requests_complete(live_server: LiveServer) -> None:
    prompts = shakespeare_prompts(200, start=100, words=6)
    start = live_server.wait_idle()

    async def one(client: httpx.AsyncClient, i: int, prompt: str) -> dict:
        if i % 4:
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 3,
                "temperature": 0.8,
                "seed": i,
            }
            resp = await client.post("/v1/completions", json=body)
        else:
            msgs = [{"role": "user", "content": prompt}]
            body = {"model": MODEL, "messages": msgs, "max_tokens": 3, "temperature": 0}
            resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=live_server.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i, p) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    assert len(results) == 200
    assert all(1 <= r["usage"]["completion_tokens"] <= 3 for r in results)
    end = live_server.wait_idle()
    assert end["free_blocks"] == start["free_blocks"] == end["total_blocks"]


def test_queue_full_is_429(live_server: LiveServer) -> None:
    aengine = live_server.app.state.async_engine
    live_server.wait_idle()
    aengine.max_queue = 2  # the bound `--max-queue 2` would set; restored below

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {
            "model": MODEL,
            "prompt": f"Count to {i}:",
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        }
        return await client.post("/v1/completions", json=body)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=live_server.url, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(8)))

    try:
        responses = asyncio.run(main())
    finally:
        aengine.max_queue = 256
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= 2
    full = next(r for r in responses if r.status_code == 429).json()["error"]
    assert full["type"] == "rate_limit_error" and full["code"] == "queue_full"
    assert "max_queue=2" in full["message"]
    metrics = parse_prometheus(httpx.get(f"{live_server.url}/metrics").text)
    assert metrics['zserve_http_responses_total{code="429",path="/v1/completions"}'] >= 1


def _held_blocks(live_server: LiveServer) -> int:
    h = live_server.health()
    return h["total_blocks"] - h["free_blocks"]


def test_client_disconnect_frees_kv_blocks(live_server: LiveServer) -> None:
    start = live_server.wait_idle()
    body = {
        "model": MODEL,
        "prompt": shakespeare_prompts(1, start=7)[0],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{live_server.url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few events in: the request holds KV blocks
        assert sum(ln.startswith("data: {") for ln in got) >= 3
        assert _held_blocks(live_server) > 0
    # the client has gone; the server must abort the request long before its 400 tokens
    end = live_server.wait_idle(timeout_s=20)
    assert end["free_blocks"] == start["free_blocks"], end

    # the same for a client that gives up on a whole (non-streamed) completion
    body = {**body, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=1.5)
    end = live_server.wait_idle(timeout_s=20)
    assert end["free_blocks"] == start["free_blocks"], end
    metrics = parse_prometheus(httpx.get(f"{live_server.url}/metrics").text)
    assert metrics['zserve_requests_total{outcome="aborted"}'] >= 2


@pytest.mark.parametrize(
    "requests",
    [200, pytest.param(1000, marks=pytest.mark.slow(reason="the 200-request case, 5x longer"))],
)
def test_free_blocks_return_after_many_requests(live_server: LiveServer, requests: int) -> None:
    start = live_server.wait_idle()
    before = parse_prometheus(httpx.get(f"{live_server.url}/metrics").text)
    prompts = shakespeare_prompts(250, start=500, words=4)
    # a shared opening (two full KV blocks and more) so the prefix cache is exercised too
    shared = " ".join(shakespeare_prompts(2, start=20))

    async def one(client: httpx.AsyncClient, sem: asyncio.Semaphore, i: int) -> int:
        prompt = prompts[i % 250] if i % 10 else f"{shared} {prompts[i % 250]}"
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1 + i % 2, "temperature": 0}
        async with sem:
            resp = await client.post("/v1/completions", json=body)
        return resp.status_code

    async def main() -> list[int]:
        sem = asyncio.Semaphore(64)
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=live_server.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, sem, i) for i in range(requests)))

    t0 = time.perf_counter()
    codes = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    assert codes == [200] * requests
    end = live_server.wait_idle()
    assert end["free_blocks"] == start["free_blocks"] == end["total_blocks"], (start, end)
    assert end["prefix_hits"] > start["prefix_hits"]  # the shared opening was reused
    after = parse_prometheus(httpx.get(f"{live_server.url}/metrics").text)
    key = 'zserve_requests_total{outcome="completed"}'
    assert after[key] - before.get(key, 0) == requests
    assert after["zserve_kv_free_blocks"] == end["free_blocks"]
    assert after["zserve_request_latency_seconds_count"] >= requests
    print(f"{requests} requests in {elapsed:.1f} s")
