"""Tool calling through the `openai` client, on SmolLM2's weights served with a chat
template that renders tools (Qwen2.5's Hermes-style `<tools>` block in SmolLM2's ChatML;
SmolLM2's own template has no tool support, which `test_openai_client.py` shows is a 400).

`tool_choice` "required" and a named function are constrained decoding: the answer is a
call of a given tool whose arguments match its parameters, returned as `tool_calls` with
finish_reason "tool_calls". "auto" leaves the model free; the tools reach its prompt."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.utils.models import smollm2_dir
from tests.zserve.server.conftest import serving

TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] != 'system' %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'assistant' and message['tool_calls'] is defined %}
{{- '<|im_start|>assistant' }}
{%- for call in message['tool_calls'] %}
{{- '\\n<tool_call>\\n{"name": "' + call['function']['name'] + '", "arguments": ' }}
{{- call['function']['arguments'] + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message['role'] == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}
{%- elif not (loop.first and message['role'] == 'system' and tools) %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
NOPE = {"type": "function", "function": {"name": "nope"}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def tools_dir(out: Path) -> Path:
    """SmolLM2 (weights and tokenizer linked) with TOOLS_TEMPLATE as its chat template."""
    src = smollm2_dir()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        (out / name).symlink_to(src / name)
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (out / "chat_template.jinja").write_text(TOOLS_TEMPLATE, encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from zserve.engine import Engine

    model = tools_dir(tmp_path_factory.mktemp("models") / "SmolLM2-tools")
    with serving(Engine(model, max_model_len=1024)) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _call(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model="SmolLM2-tools", messages=ASK, max_tokens=48, temperature=0, **kwargs
    ).choices[0]


def test_required_tool_choice_returns_a_valid_call(client: openai.OpenAI) -> None:
    choice = _call(client, tools=[WEATHER, CLOCK], tool_choice="required")
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        assert isinstance(args["city"], str)
    else:
        assert call.function.name == "get_time" and set(args) == {"timezone"}


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = _call(client, tools=[WEATHER, CLOCK], tool_choice=named)
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_time"
    assert isinstance(json.loads(call.function.arguments)["timezone"], str)


def test_a_call_and_its_result_reach_the_next_turn(client: openai.OpenAI) -> None:
    # the call a first turn made (as the required case returns it), and its result
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
    ]
    got = client.chat.completions.create(
        model="SmolLM2-tools",
        messages=history,
        max_tokens=6,
        temperature=0,
        tools=[WEATHER],
        tool_choice="none",
    )
    choice = got.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    # the call's text and the result are in the prompt: more tokens than the first turn's
    first_prompt = client.chat.completions.create(
        model="SmolLM2-tools", messages=ASK, max_tokens=1, tools=[WEATHER]
    ).usage.prompt_tokens
    call_tokens = len(arguments) // 8 + len('{"temperature": 18}') // 8
    assert got.usage.prompt_tokens > first_prompt + call_tokens


@pytest.mark.slow  # 48 free tokens: the constrained cases above are the fast check
def test_auto_puts_the_tools_in_the_prompt(client: openai.OpenAI) -> None:
    with_tools = client.chat.completions.create(
        model="SmolLM2-tools", messages=ASK, max_tokens=48, temperature=0, tools=[WEATHER]
    )
    plain = client.chat.completions.create(
        model="SmolLM2-tools", messages=ASK, max_tokens=1, temperature=0
    )
    rendered = len(json.dumps(WEATHER)) // 8  # a generous floor on the tool's tokens
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + rendered
    choice = with_tools.choices[0]
    if choice.message.tool_calls:  # the model chose to call: a parsed call of get_weather
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "get_weather"
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


@pytest.mark.parametrize(
    ("param", "kwargs"),
    [
        ("stream", {"tools": [WEATHER], "stream": True}),
        ("tool_choice", {"tools": [WEATHER], "tool_choice": NOPE}),
        ("tool_choice", {"tool_choice": "required"}),  # no tools
    ],
)
def test_tool_requests_it_cannot_honour_are_named_400s(
    client: openai.OpenAI, param: str, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _call(client, **kwargs)
    err = info.value.response.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}:"), err
