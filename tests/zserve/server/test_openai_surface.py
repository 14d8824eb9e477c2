"""The OpenAI surface beyond plain text, over real HTTP on loopback with SmolLM2: fields
zserve does not implement are a 400 naming them (no-op values pass), every error has
OpenAI's shape, `logprobs` (completions and chat, whole and streamed) equal the engine's,
`stream_options.include_usage`, `echo` (lm-eval's loglikelihood request) and `n` > 1
sharing the prompt's KV blocks. Raw httpx, to see the exact bodies; `test_openai_client.py`
drives the same server with the `openai` package."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.zserve.server.conftest import LiveServer, shakespeare_prompts
from zserve.sampling import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
ATOL = 1e-4  # the server's batches differ from the reference engine's: float sum order
CHAT = [{"role": "user", "content": "Name a play by Shakespeare."}]


def _post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _stream(server: LiveServer, path: str, body: dict) -> list[dict]:
    with httpx.stream(
        "POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _engine_run(engine, prompt, params: SamplingParams) -> dict:
    engine.add_request("ref", prompt, params)
    got = {"tokens": [], "lps": [], "prompt": None}
    while engine.has_unfinished():
        for out in engine.step():
            got["tokens"] += out.token_ids
            got["lps"] += out.logprobs or []
            got["prompt"] = got["prompt"] or out.prompt_logprobs
    return got


UNSUPPORTED = [
    # SmolLM2's chat template never reads `tools`: the model could not see them
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "auto"),  # without tools
    ("/v1/chat/completions", "frequency_penalty", 0.5),
    ("/v1/completions", "presence_penalty", 0.5),
    ("/v1/completions", "logit_bias", {"50256": -100}),
    ("/v1/completions", "best_of", 2),
    ("/v1/completions", "suffix", "end"),
    ("/v1/completions", "temperatur", 0.5),  # a typo is not silently dropped either
]


@pytest.mark.parametrize(("path", "field", "value"), UNSUPPORTED)
def test_unimplemented_fields_are_a_400_naming_them(
    live_server: LiveServer, path: str, field: str, value: object
) -> None:
    body = {"model": MODEL, "max_tokens": 1, field: value}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": "Hi"})
    resp = _post(live_server, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err == {**err, "type": "invalid_request_error", "param": field, "code": None}
    assert err["message"].startswith(f"{field}:"), err["message"]


def test_no_op_values_of_unimplemented_fields_pass(live_server: LiveServer) -> None:
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 1,
        "tools": [],
        "response_format": {"type": "text"},
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": None,
        "user": "u-1",
        "n": 1,
    }
    assert _post(live_server, "/v1/chat/completions", body).status_code == 200
    bad = {**body, "messages": [{**CHAT[0], "tool_calls": []}]}
    err = _post(live_server, "/v1/chat/completions", bad).json()["error"]
    assert err["param"] == "messages.0.tool_calls", err
    bad = {**body, "top_logprobs": 2}
    err = _post(live_server, "/v1/chat/completions", bad).json()["error"]
    assert err["param"] == "top_logprobs" and "logprobs: true" in err["message"], err


@pytest.mark.parametrize(
    ("method", "path", "content", "status"),
    [
        ("POST", "/v1/completions", b'{"model": "m", "prompt": ', 400),
        ("POST", "/v1/completions", b"not json at all", 400),
        ("POST", "/v1/completions", b'{"prompt": "hi"}', 400),  # FastAPI's 422 case
        ("POST", "/v1/chat/completions", b'{"model": "nope", "messages": []}', 400),
        ("POST", "/v1/embeddings", b"{}", 404),
        ("GET", "/v1/completions", b"", 405),
    ],
)
def test_every_error_has_openais_shape(
    live_server: LiveServer, method: str, path: str, content: bytes, status: int
) -> None:
    resp = httpx.request(
        method,
        live_server.url + path,
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body  # never FastAPI's {"detail": ...}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


def test_completion_logprobs_equal_the_engines(live_server: LiveServer, reference_engine) -> None:
    prompt = shakespeare_prompts(1, start=80)[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3}
    resp = _post(live_server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    lp = choice["logprobs"]
    want = _engine_run(
        reference_engine, prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=3)
    )
    assert len(lp["tokens"]) == len(want["tokens"]) == len(lp["token_logprobs"])
    for got_lp, got_top, w in zip(
        lp["token_logprobs"], lp["top_logprobs"], want["lps"], strict=True
    ):
        assert got_lp == pytest.approx(w.logprob, abs=ATOL)
        assert len(got_top) <= 3 and max(got_top.values()) == pytest.approx(got_lp, abs=1e-6)
    text = "".join(lp["tokens"])
    assert text.startswith(choice["text"])  # an EOS token is in tokens, not in text
    offsets = [0]
    for tok in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lp["text_offset"] == offsets

    chunks = _stream(live_server, "/v1/completions", body)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [t for s in streamed for t in s["text_offset"]] == lp["text_offset"]
    got = [t for s in streamed for t in s["token_logprobs"]]
    assert got == pytest.approx(lp["token_logprobs"], abs=ATOL)


def test_chat_logprobs(live_server: LiveServer) -> None:
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    resp = _post(live_server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == resp.json()["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        assert len(entry["top_logprobs"]) == 2
    raw = b"".join(bytes(e["bytes"]) for e in content).decode()
    assert raw.startswith(choice["message"]["content"])

    chunks = _stream(live_server, "/v1/chat/completions", body)
    streamed = [
        e
        for c in chunks
        if c["choices"][0].get("logprobs")
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    # without logprobs: no logprobs key value
    plain = _post(
        live_server, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None}
    )
    assert plain.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_include_usage_sends_a_last_chunk_with_usage_and_no_choices(
    live_server: LiveServer, path: str
) -> None:
    body = {"model": MODEL, "max_tokens": 5, "temperature": 0}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": "Once upon a time"})
    whole = _post(live_server, path, body).json()
    chunks = _stream(live_server, path, {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    plain = _stream(live_server, path, body)
    assert all(c["choices"] for c in plain)  # no usage chunk unless asked
    err = _post(live_server, path, {**body, "stream_options": {"include_usage": True}})
    assert err.status_code == 400 and err.json()["error"]["param"] == "stream_options"


def test_echo_scores_the_prompt_as_lm_eval_asks(live_server: LiveServer, reference_engine) -> None:
    prompt = shakespeare_prompts(1, start=90)[0]
    ids = reference_engine.tokenizer.encode(prompt)
    # lm-eval's loglikelihood: token ids, echo, logprobs, and 0 (or 1) new tokens
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
    resp = _post(live_server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    got = resp.json()
    lp = got["choices"][0]["logprobs"]
    assert got["choices"][0]["text"] == reference_engine.tokenizer.decode(
        ids, skip_special_tokens=False
    )
    assert got["usage"]["completion_tokens"] == 0
    assert len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = _engine_run(reference_engine, ids, SamplingParams(max_tokens=0, prompt_logprobs=1))
    have = lp["token_logprobs"][1:]
    assert have == pytest.approx([e.logprob for e in want["prompt"][1:]], abs=ATOL)

    one = _post(live_server, "/v1/completions", {**body, "max_tokens": 1, "temperature": 0}).json()
    lp1 = one["choices"][0]["logprobs"]
    assert len(lp1["token_logprobs"]) == len(ids) + 1
    assert lp1["token_logprobs"][1:-1] == pytest.approx(have, abs=ATOL)

    # echo without logprobs: the prompt text, then the completion
    plain = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    gen = _post(live_server, "/v1/completions", plain).json()["choices"][0]["text"]
    echoed = _post(live_server, "/v1/completions", {**plain, "echo": True}).json()
    assert echoed["choices"][0]["text"] == prompt + gen
    chunks = _stream(live_server, "/v1/completions", {**plain, "echo": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt + gen
    err = _post(live_server, "/v1/completions", {**plain, "max_tokens": 0})
    assert err.status_code == 400 and err.json()["error"]["param"] == "max_tokens"


def test_n_choices_share_the_prompts_kv_blocks(live_server: LiveServer) -> None:
    live_server.wait_idle()
    prompt = "A tale of n choices: " + " ".join(shakespeare_prompts(2, start=130))
    n_prompt = len(live_server.engine.tokenizer.encode(prompt))
    before = live_server.health()["prefix_hits"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "n": 3}
    got = _post(live_server, "/v1/completions", body).json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in got["choices"]}) == 1  # greedy: the same answer
    assert got["usage"]["completion_tokens"] == 3 * 5
    # choices 1 and 2 reused every full block of choice 0's prompt
    block = 16
    assert live_server.health()["prefix_hits"] - before == 2 * ((n_prompt - 1) // block) * block

    sampled = {**body, "temperature": 1.0, "seed": 7, "max_tokens": 8}
    a = [c["text"] for c in _post(live_server, "/v1/completions", sampled).json()["choices"]]
    b = [c["text"] for c in _post(live_server, "/v1/completions", sampled).json()["choices"]]
    assert a == b and len(set(a)) > 1  # seeded: reproducible, and each choice its own seed
    single = _post(live_server, "/v1/completions", {**sampled, "n": 1}).json()
    assert single["choices"][0]["text"] == a[0]

    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0, "n": 2}
    chunks = _stream(live_server, "/v1/chat/completions", chat)
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
    whole = _post(live_server, "/v1/chat/completions", chat).json()
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]
    end = live_server.wait_idle()
    assert end["free_blocks"] == end["total_blocks"]
