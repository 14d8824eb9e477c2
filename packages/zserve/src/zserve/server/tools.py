"""Tool calling: ``tools`` rendered by the model's chat template, calls decoded to JSON.

The tools reach the prompt only through the chat template's ``tools`` variable, as
transformers passes them (a list of OpenAI ``{"type": "function", "function": {...}}``
dicts): a template that never reads ``tools`` cannot tell the model about them, so a
request with tools for such a model is a 400 naming ``tools``, never a prompt that
silently dropped them.

``tool_choice``:

- ``"required"`` or a named function: the output is constrained (`zserve.structured`)
  to one call, ``{"name": ..., "arguments": {...}}``, whose arguments match that
  function's ``parameters`` schema; the choice ends with finish_reason "tool_calls".
- ``"auto"`` (the default with tools): the model writes what it likes; if its answer is
  a call (bare, or in ``<tool_call>...</tool_call>`` as Hermes/Qwen-style templates ask),
  it is returned as ``tool_calls``, else as content.
- ``"none"``: the tools are in the prompt, and the answer is text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from zserve.server.tool_protocol import FunctionCall, NamedToolChoice, Tool, ToolCall
from zserve.structured.spec import GrammarSpec, json_schema

_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def template_reads_tools(template: str) -> bool:
    """Whether the chat template reads a ``tools`` variable (jinja2's own parse, so a
    word "tools" in the template's text does not count)."""
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    return "tools" in meta.find_undeclared_variables(env.parse(template))


def render_chat_with_tools(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[Tool]
) -> list[int]:
    """Token ids of the chat prompt with ``tools`` in the template's ``tools`` variable.
    ValueError (message starting with ``tools:``) when the template does not read it."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = getattr(tokenizer, "chat_template", None)
    if not template or not template_reads_tools(template):
        raise ValueError(
            "tools: this model's chat template has no tool support (it never reads a "
            "`tools` variable), so the model would not see them; leave tools out, or "
            "serve a model whose chat template renders tools"
        )

    def raise_exception(message: str) -> None:
        raise ValueError(f"messages: chat template: {message}")

    # the same environment `zserve.tokenizer.Tokenizer` renders chat with
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    try:
        text = env.from_string(template).render(
            messages=messages,
            tools=[t.model_dump(exclude_none=True) for t in tools],
            add_generation_prompt=True,
            bos_token=getattr(tokenizer, "bos_token", None) or "",
            eos_token=getattr(tokenizer, "eos_token", None) or "",
        )
    except ValueError:
        raise
    except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise ValueError(
            f"tools: the model's chat template failed on these tools and messages: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


def call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of one call of ``tool``: its name, and arguments its parameters
    schema allows."""
    params = tool.function.parameters
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": params if params else _NO_ARGUMENTS,
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_spec(tools: list[Tool], choice: Any) -> GrammarSpec | None:
    """The grammar a ``tool_choice`` imposes: one call of the named function, or of any
    tool for "required"; None for "auto" / "none" (free text)."""
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
    elif choice == "required":
        chosen = tools
    else:
        return None
    schemas = [call_schema(t) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    try:
        return json_schema(schema, kind="tool_call")
    except ValueError as exc:
        raise ValueError(f"tools: a function's parameters are not a usable schema: {exc}") from exc


def parse_tool_calls(text: str, tools: list[Tool]) -> list[ToolCall] | None:
    """The calls in a model's answer, or None when it is not (only) calls of ``tools``.

    Accepted: one JSON call ``{"name", "arguments"}`` (``"parameters"`` too, as Llama 3's
    template asks), a JSON list of them, or such JSON inside ``<tool_call>`` tags."""
    names = {t.function.name for t in tools}
    tagged = _TAGGED.findall(text)
    blobs = tagged if tagged else [text.strip()]
    calls: list[ToolCall] = []
    for blob in blobs:
        try:
            value = json.loads(blob)
        except json.JSONDecodeError:
            return None
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict) or item.get("name") not in names:
                return None
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):  # some models write the arguments as a JSON text
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if not isinstance(args, dict):
                return None
            calls.append(
                ToolCall(
                    id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=item["name"], arguments=json.dumps(args)),
                )
            )
    return calls or None
