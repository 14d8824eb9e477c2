"""Request validation of the OpenAI models: wrong types, bounds and unknown keys, and the
error message that names the field and the value sent."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from zserve.server.protocol import (
    ChatCompletionRequest,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    describe_validation_error,
    error_body,
    validation_error_details,
)
from zserve.server.responses import sse_event


def _fail(model, payload: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(json.dumps(payload))
    return validation_error_details(info.value)


def test_defaults_follow_openai() -> None:
    req = CompletionRequest.model_validate_json('{"model": "m", "prompt": "hi"}')
    assert (req.max_tokens, req.temperature, req.top_p, req.stream, req.n) == (
        16,
        1.0,
        1.0,
        False,
        1,
    )
    assert req.stop_strings() == ()
    assert CompletionRequest(model="m", prompt="x", stop="\n").stop_strings() == ("\n",)
    # unknown keys that clients routinely send are ignored, not rejected
    req = CompletionRequest.model_validate_json(
        '{"model":"m","prompt":[1,2],"user":"u","logprobs":null}'
    )
    assert req.prompt == [1, 2]


@pytest.mark.parametrize(
    ("payload", "field", "shown"),
    [
        ({"model": "m", "prompt": "a", "max_tokens": "5"}, "max_tokens", "'5'"),
        ({"model": "m", "prompt": "a", "max_tokens": 0}, "max_tokens", "0"),
        ({"model": "m", "prompt": "a", "max_tokens": -3}, "max_tokens", "-3"),
        ({"model": "m", "prompt": "a", "temperature": "hot"}, "temperature", "'hot'"),
        ({"model": "m", "prompt": "a", "stream": "yes"}, "stream", "'yes'"),
        ({"model": "m", "prompt": 5}, "prompt", "5"),
        ({"model": 7, "prompt": "a"}, "model", "7"),
        ({"model": "m", "prompt": "a", "top_p": 1.5}, "top_p", "1.5"),
        ({"model": "m", "prompt": "a", "n": 17}, "n", "17"),
    ],
)
def test_wrong_values_name_the_field_and_value(payload: dict, field: str, shown: str) -> None:
    message, param = _fail(CompletionRequest, payload)
    assert param == field
    assert message.startswith(f"{field}:"), message
    assert f"(got {shown})" in message


def test_missing_and_nested_fields() -> None:
    message, param = _fail(CompletionRequest, {"model": "m"})
    assert param == "prompt" and "Field required" in message
    message, param = _fail(
        ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": 3}]}
    )
    assert param == "messages.0.content" and "(got 3)" in message
    message, param = _fail(
        ChatCompletionRequest, {"model": "m", "messages": [{"role": "robot", "content": "x"}]}
    )
    assert param == "messages.0.role" and "'robot'" in message
    _, param = _fail(ChatCompletionRequest, {"model": "m", "messages": []})
    assert param == "messages"


def test_malformed_json_is_described() -> None:
    # FastAPI reports a body that is not JSON as one "json_invalid" error at ("body", pos)
    errors = [
        {
            "type": "json_invalid",
            "loc": ("body", 9),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": "Expecting ',' delimiter"},
        }
    ]
    message, param = describe_validation_error(errors)
    assert param is None
    assert message == "malformed JSON body: Expecting ',' delimiter; send a JSON object"


def test_error_body_shape_and_sse_framing() -> None:
    body = error_body("max_tokens: bad", param="max_tokens")
    assert body == {
        "error": {
            "message": "max_tokens: bad",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": None,
        }
    }
    assert sse_event("[DONE]") == "data: [DONE]\n\n"
    chunk = CompletionResponse(id="c1", model="m", choices=[CompletionChoice(text="a\nb")])
    event = sse_event(chunk)
    # one event: a single data line (newlines in text are JSON-escaped), blank-line terminated
    assert event.startswith("data: {") and event.endswith("}\n\n") and event.count("\n") == 2
    assert json.loads(event[len("data: ") :])["choices"][0]["text"] == "a\nb"
