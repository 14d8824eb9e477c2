"""The request and response models of `response_format` and tool calling (OpenAI's
shapes), beside `protocol.py`: a JSON schema to answer in, the tools a model may call,
`tool_choice`, and the calls (made now, or in a conversation's earlier turns)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Request(BaseModel):
    # as `protocol._Request`: strict types, unknown keys are a 400
    model_config = ConfigDict(strict=True, extra="forbid")


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: the schema the answer must match."""

    name: str = Field(min_length=1, max_length=64, description="The schema's name.")
    description: str | None = None
    schema_: dict[str, Any] = Field(
        default_factory=dict, alias="schema", description="A JSON schema ({} allows any JSON)."
    )
    strict: bool | None = Field(
        default=None, description="zserve always decodes to the schema: strict or not."
    )


class ResponseFormat(_Request):
    """``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> Any:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                "response_format: json_schema is required with type 'json_schema' and "
                f"allowed with it only (got type {self.type!r})"
            )
        return self


class FunctionDef(_Request):
    """A function the model may call."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="JSON schema of the arguments (an object); None: no arguments."
    )
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class FunctionCallIn(_Request):
    name: str
    arguments: str = Field(description="The arguments as a JSON text, as OpenAI sends them.")


class ToolCallIn(_Request):
    """A call an earlier assistant turn made (a tool-calling conversation's history)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments as a JSON text (OpenAI's shape)."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
