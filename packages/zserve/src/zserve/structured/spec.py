"""What a constrained request asks for: a grammar, as llguidance's JSON grammar text.

Built from OpenAI's ``response_format`` (`json_object`, `json_schema`) or from a request's
tools (`zserve.server.tools`). Frozen and hashable, so it rides in the frozen
`SamplingParams` and `dataclasses.replace` copies it to each of ``n`` choices.

JSON is written compactly (``", "`` and ``": "`` separators, no other whitespace): a
small model left free to emit whitespace may fill ``max_tokens`` with newlines and never
close the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# llguidance's JSON compiler options: compact separators, no free whitespace
_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar for one request's output."""

    grammar: str
    """llguidance's grammar text (``{"grammars": [...]}``)."""
    kind: str
    """What it is, for messages: "json_object", "json_schema" or "tool_call"."""


def _from_schema(schema: dict[str, Any], kind: str) -> GrammarSpec:
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    return GrammarSpec(grammar=grammar, kind=kind)


def json_object() -> GrammarSpec:
    """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
    return _from_schema({"type": "object"}, "json_object")


def json_schema(schema: dict[str, Any], kind: str = "json_schema") -> GrammarSpec:
    """A JSON value valid against ``schema``. ValueError naming what llguidance rejects
    (an unsupported keyword, a schema that is not an object)."""
    import llguidance

    if not isinstance(schema, dict):
        raise ValueError(f"the schema is a {type(schema).__name__}; send a JSON object")
    try:
        spec = _from_schema(schema, kind)
    except ValueError as exc:
        raise ValueError(f"not a usable JSON schema: {exc}") from exc
    error = llguidance.LLMatcher.validate_grammar(spec.grammar)
    if error:
        raise ValueError(f"not a usable JSON schema: {error.strip()}")
    return spec
