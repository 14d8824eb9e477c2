"""A server whose KV cache holds less than SmolLM2's 8192-token context: its max_model_len is
what the cache holds, so chat without `max_tokens` (which asks for the rest of the context)
runs to the end of the cache, and a request that can never fit is a 400 naming `max_tokens`
before anything runs (it was a 500, or an SSE error after a 200 when streaming)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.utils.models import smollm2_dir
from tests.zserve.server.conftest import LiveServer, serving

MODEL = "SmolLM2-135M-Instruct"
KV_BLOCKS, BLOCK_SIZE = 7, 4
# 28 slots hold a 29-token sequence: its last sampled token is never fed back
LIMIT = KV_BLOCKS * BLOCK_SIZE + 1
CHAT = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ],  # 18 prompt tokens: 11 left
    "temperature": 0,
    "ignore_eos": True,  # run to the very end of the context
}


@pytest.fixture(scope="module")
def small_cache_server() -> Iterator[LiveServer]:
    from zserve.engine import Engine

    engine = Engine(smollm2_dir(), num_blocks=KV_BLOCKS, block_size=BLOCK_SIZE)
    with serving(engine) as server:
        yield server


def test_max_model_len_is_what_the_kv_cache_holds(small_cache_server: LiveServer) -> None:
    assert small_cache_server.engine.runner.max_model_len == 8192  # the model's own
    models = httpx.get(f"{small_cache_server.url}/v1/models", timeout=10).json()
    assert [m["max_model_len"] for m in models["data"]] == [LIMIT]


def test_chat_without_max_tokens_runs_to_the_end_of_the_cache(
    small_cache_server: LiveServer,
) -> None:
    url = f"{small_cache_server.url}/v1/chat/completions"
    resp = httpx.post(url, json=CHAT, timeout=60)
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert got["usage"]["total_tokens"] == LIMIT
    assert got["choices"][0]["finish_reason"] == "length"

    with httpx.stream("POST", url, json={**CHAT, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == got["choices"][0]["message"]["content"]
    assert small_cache_server.wait_idle()["free_blocks"] == KV_BLOCKS


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": LIMIT}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 12}),
    ],
)
def test_too_big_for_the_cache_is_400_naming_max_tokens(
    small_cache_server: LiveServer, path: str, body: dict, stream: bool
) -> None:
    resp = httpx.post(f"{small_cache_server.url}{path}", json={**body, "stream": stream})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded", err
    assert f"context of {LIMIT} tokens" in err["message"], err["message"]
    assert "ask for at most" in err["message"], err["message"]
    health = small_cache_server.wait_idle()
    assert health["free_blocks"] == KV_BLOCKS and health["status"] == "ok"
