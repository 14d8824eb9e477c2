"""The `openai` Python client against zserve on loopback (SmolLM2, the shared live server):
what issue 20 asks a real client to get. Logprobs (completions and chat), `n` = 2, `echo`
with the prompt's logprobs, stream usage, JSON mode and a JSON schema answered by
constrained decoding (the content parses, and matches the schema), `finish_reason`
"length" when `max_tokens` cannot close the JSON, and a 400 naming the field the client
sent that zserve does not do, with OpenAI's error body (also for a body that does not
parse)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.zserve.server.conftest import LiveServer

MODEL = "SmolLM2-135M-Instruct"
ASK_JSON = [
    {"role": "user", "content": "Give the title and year of one play by Shakespeare as JSON."}
]
PLAY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1500, "maximum": 1700},
        "genre": {"enum": ["comedy", "tragedy", "history"]},
    },
    "required": ["title", "year", "genre"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0)


def _matches_play_schema(value: Any) -> None:
    """PLAY_SCHEMA, checked by hand (no jsonschema package in the venv)."""
    assert isinstance(value, dict) and set(value) == {"title", "year", "genre"}, value
    assert isinstance(value["title"], str)
    assert isinstance(value["year"], int) and 1500 <= value["year"] <= 1700, value
    assert value["genre"] in ("comedy", "tragedy", "history"), value


def _openai_error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_completion_logprobs_echo_and_n(client: openai.OpenAI) -> None:
    prompt = "Now is the winter of our discontent"
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, n=2
    )
    assert [c.index for c in got.choices] == [0, 1]
    assert got.choices[0].text == got.choices[1].text  # greedy choices agree
    lp = got.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy: the likeliest
    assert got.usage.completion_tokens == 2 * 4

    # echo: the prompt's text first, and a logprob for every prompt token after the first
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    choice = echoed.choices[0]
    assert choice.text.startswith(prompt)
    n_prompt = echoed.usage.prompt_tokens
    assert len(choice.logprobs.token_logprobs) == n_prompt + 1
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v <= 0 for v in choice.logprobs.token_logprobs[1:])
    # the generated token's logprob is the one the plain request reported
    assert choice.logprobs.token_logprobs[-1] == pytest.approx(lp.token_logprobs[0], abs=1e-4)


def test_batched_token_prompts_number_choices_by_prompt(
    client: openai.OpenAI, live_server: LiveServer
) -> None:
    # lm-eval's local-completions sends token-id prompts as a batch: [[ids], [ids]]
    texts = ["To be, or not", "Friends, Romans"]
    single = [
        client.completions.create(model=MODEL, prompt=t, max_tokens=2, temperature=0) for t in texts
    ]
    ids = [live_server.engine.tokenizer.encode(t) for t in texts]
    both = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]  # prompt i: i*n .. i*n+n-1
    assert [c.text for c in both.choices] == [s.choices[0].text for s in single for _ in "nn"]
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)  # once per prompt


def test_chat_logprobs_n_and_stream_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a play by Shakespeare."}]
    got = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0.8,
        seed=3,
        n=2,
        logprobs=True,
        top_logprobs=3,
    )
    assert [c.index for c in got.choices] == [0, 1]
    for c in got.choices:
        content = c.logprobs.content
        assert content and len(content) <= 5
        assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)
        raw = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
        assert raw.startswith(c.message.content)
    assert got.usage.completion_tokens == sum(len(c.logprobs.content) for c in got.choices)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens <= 5 and last.usage.prompt_tokens > 0
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0
    )
    assert text == whole.choices[0].message.content
    assert last.usage.model_dump() == whole.usage.model_dump()


def test_json_mode_answers_parse(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(
        model=MODEL,
        messages=ASK_JSON,
        max_tokens=60,
        temperature=0,
        n=2,
        response_format={"type": "json_object"},
    )
    assert len(got.choices) == 2  # each choice follows its own copy of the grammar
    assert got.choices[0].message.content == got.choices[1].message.content  # greedy
    for choice in got.choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_answer_matches_the_schema(client: openai.OpenAI, temperature: float) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "play", "schema": PLAY_SCHEMA}}
    got = client.chat.completions.create(
        model=MODEL,
        messages=ASK_JSON,
        max_tokens=60,
        temperature=temperature,
        seed=11,
        response_format=fmt,
    )
    choice = got.choices[0]
    assert choice.finish_reason == "stop", choice
    _matches_play_schema(json.loads(choice.message.content))
    # too few tokens to close the value: cut, as OpenAI does, with finish_reason "length"
    short = client.chat.completions.create(
        model=MODEL,
        messages=ASK_JSON,
        max_tokens=3,
        temperature=temperature,
        seed=11,
        response_format=fmt,
    )
    assert short.choices[0].finish_reason == "length"
    assert choice.message.content.startswith(short.choices[0].message.content)


def test_a_bad_schema_is_a_400_naming_response_format(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=ASK_JSON, max_tokens=5, response_format=fmt
        )
    err = _openai_error(info.value)
    assert err["param"].startswith("response_format"), err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("frequency_penalty", {"frequency_penalty": 0.7}),
        ("logit_bias", {"logit_bias": {"50": -100}}),
        # SmolLM2's chat template never reads `tools`: the model could not see them
        ("tools", {"tools": [{"type": "function", "function": {"name": "clock"}}]}),
        ("temperatur", {"extra_body": {"temperatur": 0.5}}),
    ],
)
def test_an_unsupported_field_is_a_400_naming_it(
    client: openai.OpenAI, field: str, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK_JSON, max_tokens=2, **kwargs)
    err = _openai_error(info.value)
    assert err["param"] == field and err["message"].startswith(f"{field}:"), err
    assert err["type"] == "invalid_request_error" and err["code"] is None
    assert info.value.param == field  # the client reads OpenAI's shape


def test_every_error_the_client_meets_has_openais_shape(
    client: openai.OpenAI, live_server: LiveServer
) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    assert _openai_error(info.value)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=100_000)
    assert _openai_error(info.value)["param"] == "max_tokens"
    # a body that does not parse (no client sends one; a proxy or a hand-written one may)
    resp = httpx.post(
        f"{live_server.url}/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 400
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "malformed JSON" in body["error"]["message"]
