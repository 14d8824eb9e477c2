"""Pydantic's ``ValidationError`` turned into :class:`ConfigProblem` lines.

Converted once, here: locations become the key paths a user wrote (union tags
such as ``optimizer.Adam.params`` lose the tag), pydantic's wording becomes
``<path> = <value>: must be ...``, and bound errors name the default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from zcore.config._base import NestedProblems, accepted_keys, field_at, model_of
from zcore.config.errors import (
    AUTO_HINT,
    MISSING,
    ConfigProblem,
    ValueProblem,
    did_you_mean,
    format_value,
    join_path,
)

_KIND = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be a whole number",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "model_type": "must be a block of keys (a JSON object)",
    "model_attributes_type": "must be a block of keys (a JSON object)",
    "dict_type": "must be a block of keys (a JSON object)",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
}
_BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def problems_from(
    error: ValidationError, root: type[BaseModel], prefix: str = ""
) -> list[ConfigProblem]:
    """One problem per pydantic error, located from ``root`` (itself at ``prefix``)."""
    problems: list[ConfigProblem] = []
    for detail in error.errors(include_url=False):
        problems += _problems(detail, root, prefix)
    return problems


def _problems(detail: Mapping[str, Any], root: type[BaseModel], prefix: str) -> list[ConfigProblem]:
    items, field = field_at(root, tuple(detail["loc"]))
    path = prefix
    for item in items:
        path = join_path(path, item)
    kind = detail["type"]
    ctx: dict[str, Any] = dict(detail.get("ctx") or {})
    value = detail.get("input", MISSING)
    raised = ctx.get("error")
    if isinstance(raised, NestedProblems):
        return problems_from(raised.error, raised.model, join_path(path, raised.key))
    if isinstance(raised, ValueProblem):
        if raised.key is None:
            return [ConfigProblem.at(path, value, raised.why)]
        return [ConfigProblem.at(join_path(path, raised.key), raised.value, raised.why)]
    if kind == "missing" and items and isinstance(items[-1], int):
        parent = path.rsplit("[", 1)[0]
        return [ConfigProblem.at(parent, MISSING, f"too few items: item [{items[-1]}] is missing")]
    if kind == "missing":
        return [ConfigProblem.at(path, MISSING, "is required" + _doc(field))]
    if kind == "extra_forbidden":
        hint = _suggest(root, tuple(detail["loc"]))
        return [ConfigProblem(path, f"unknown key {path}{hint}", value)]
    return [ConfigProblem.at(path, value, _why(kind, ctx, detail["msg"], value, field))]


def _suggest(root: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    """Did-you-mean for the unknown last key of ``loc``, among its block's keys."""
    parent: type[BaseModel] | None = root
    if len(loc) > 1:
        _, field = field_at(root, loc[:-1])
        parent = model_of(field.annotation) if field is not None else None
    key = loc[-1] if loc else None
    if parent is None or not isinstance(key, str):
        return ""
    return did_you_mean(key, accepted_keys(parent))


def _why(kind: str, ctx: dict[str, Any], msg: str, value: Any, field: FieldInfo | None) -> str:
    if kind in _BOUNDS:
        name, sign = _BOUNDS[kind]
        return f"must be {sign} {format_value(ctx[name])}{_default(field)}"
    if kind in _KIND:
        why = _KIND[kind]
        return why + (AUTO_HINT if value == "auto" else "")
    if kind == "literal_error":
        return "must be one of " + str(ctx.get("expected", "")).replace("'", '"')
    if kind in ("too_short", "too_long"):
        want = ctx.get("min_length") if kind == "too_short" else ctx.get("max_length")
        return f"must have {want} items, got {ctx.get('actual_length')}"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return f"`type` must be one of {ctx.get('expected_tags', '')}".replace("'", "")
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return str(ctx["error"])
    return msg[:1].lower() + msg[1:]


def _default(field: FieldInfo | None) -> str:
    if field is None or field.is_required() or field.default_factory is not None:
        return ""
    if field.default is None:
        return ""
    return f" (default {format_value(field.default)})"


def _doc(field: FieldInfo | None) -> str:
    """The first sentence of the field's docstring, to say what the missing key is for."""
    if field is None or not field.description:
        return ""
    first = field.description.strip().split("\n", 1)[0].split(". ", 1)[0].rstrip(".")
    return f" ({first})"
