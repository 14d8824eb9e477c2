"""The key pass: every key of a raw config checked against the models before pydantic runs.

It reports unknown keys (with a did-you-mean among the block's keys), gated
DeepSpeed features (through :mod:`zcore.config.features`), old DeepSpeed keys
(:mod:`zcore.config.old_keys`: read under their current name with an
:class:`OldKeyWarning`, rejected next to it), and ``optimizer``/``scheduler`` types that do not
exist. It returns a cleaned copy (aliases renamed, ``type`` spelled as the
model spells it, offending keys removed) so that pydantic then reports only
problems with values, and each problem is reported once.

Top-level keys another package registered (:mod:`zcore.config.blocks`) are
checked against that package's schema and handed to ``extensions`` as a
:class:`~zcore.config.blocks.FoundBlock` for :class:`ZConfig` to validate.

Blocks validated by a model zcore does not own (an optimizer's registered params
model, a registered block) are walked the same way; keys a plug-in model spells through pydantic aliases
are kept as written, and a model that allows extra keys gets them unchecked.
"""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import BaseModel

from zcore.config import blocks, features, plugins
from zcore.config._base import (
    ZModel,
    accepted_keys,
    forbids_extra,
    key_names,
    model_of,
    old_names,
    tagged_members,
)
from zcore.config.errors import MISSING, ConfigProblem, ValueProblem, did_you_mean, join_path
from zcore.config.old_keys import NOTHING, OldKey, OldKeyWarning

_DROP = object()


def check_keys(
    model: type[BaseModel],
    data: dict[str, Any],
    prefix: str,
    problems: list[ConfigProblem],
    extensions: dict[str, Any],
    dynamic: dict[str, type[BaseModel]] | None = None,
) -> dict[str, Any]:
    """``data`` for ``model`` at ``prefix`` with bad keys removed; problems appended.

    Values of keys unlocked with :func:`~zcore.config.register_feature` that
    ``model`` has no field for go to ``extensions`` by full path. ``dynamic`` gives
    the model of fields that depend on the data (:meth:`ZModel.dynamic_blocks`).
    """
    fields = model.model_fields
    spellings = key_names(model)
    old = old_names(model)
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = join_path(prefix, key)
        if key in old:
            renamed = _old_key(key, old[key], value, data, prefix, problems)
            if renamed is None:
                continue
            name, value = renamed
        else:
            name = spellings.get(key)
        if name is None:
            if not prefix and _plugin_block(key, value, problems, extensions):
                continue
            if features.is_registered(path):
                extensions[path] = value
            elif path in features.GATED:
                problem = features.gate(path, value)
                if problem is not None:
                    problems.append(problem)
                elif features.is_registered(path):  # gate() imported the package unlocking it
                    extensions[path] = value
            elif forbids_extra(model):
                problems.append(_unknown_key(model, key, path, value))
            else:
                out[key] = value
            continue
        if name != key and name in data:  # a plug-in model's pydantic alias next to its name
            problems.append(_both_given(path, value, key, name, "another name"))
            continue
        field_path = join_path(prefix, name)
        problem = features.gate(field_path, value)
        if problem is not None:
            problems.append(problem)
        annotation = (dynamic or {}).get(name, fields[name].annotation)
        checked = _descend(annotation, value, field_path, problems, extensions)
        if checked is not _DROP:
            out[key if key in spellings and key not in old else name] = checked
    return out


def _old_key(
    key: str,
    entry: OldKey,
    value: Any,
    data: dict[str, Any],
    prefix: str,
    problems: list[ConfigProblem],
) -> tuple[str, Any] | None:
    """An old DeepSpeed key: (current key, value) to read it as, with an OldKeyWarning;
    None when it sets nothing or cannot be read (then a problem is appended)."""
    path = join_path(prefix, key)
    if entry.new in data:
        problems.append(_both_given(path, value, key, entry.new, "DeepSpeed's old name"))
        return None
    try:
        new_value = entry.value(value)
    except ValueProblem as problem:
        problems.append(ConfigProblem.at(path, value, problem.why))
        return None
    new_path = join_path(prefix, entry.new)
    warnings.warn(entry.warning(path, new_path, value, new_value), OldKeyWarning, stacklevel=1)
    return None if new_value is NOTHING else (entry.new, new_value)


def _both_given(path: str, value: Any, key: str, name: str, what: str) -> ConfigProblem:
    return ConfigProblem.at(
        path, value, f"`{key}` is {what} for `{name}`, which is also given; keep only `{name}`"
    )


def _plugin_block(
    key: str, value: Any, problems: list[ConfigProblem], extensions: dict[str, Any]
) -> bool:
    """Whether top-level ``key`` is a block another package registered (then checked)."""
    try:
        schema = blocks.config_block(key)
    except plugins.PluginError as error:
        problems.append(ConfigProblem(key, f"{key}: {error}", value))
        return True
    if schema is None:
        return False
    if isinstance(schema, type):
        value = _descend(schema, value, key, problems, extensions)
    if value is not _DROP:
        extensions[key] = blocks.FoundBlock(schema, value)
    return True


def _unknown_key(model: type[BaseModel], key: str, path: str, value: Any) -> ConfigProblem:
    valid = accepted_keys(model)
    if "." not in path:
        valid += blocks.registered_config_blocks()
    hint = did_you_mean(key, valid)
    if not hint:
        hint = "; valid keys here: " + ", ".join(sorted(valid))
    return ConfigProblem(path, f"unknown key {path}{hint}", value)


def _descend(
    annotation: Any,
    value: Any,
    path: str,
    problems: list[ConfigProblem],
    extensions: dict[str, Any],
) -> Any:
    """Check the keys inside ``value`` when the field holds a block; other values pass."""
    if not isinstance(value, dict):
        return value
    members = tagged_members(annotation)
    if members is not None:
        return _typed_block(members, value, path, problems, extensions)
    sub = model_of(annotation)
    if sub is None:
        return value
    dynamic = None
    if issubclass(sub, ZModel):
        try:
            dynamic = sub.dynamic_blocks(value)
        except ValueProblem as problem:
            where = join_path(path, problem.key) if problem.key else path
            problems.append(ConfigProblem.at(where, problem.value, problem.why))
            return _DROP
    return check_keys(sub, value, path, problems, extensions, dynamic)


def _typed_block(
    members: dict[str, type[Any]],
    value: dict[str, Any],
    path: str,
    problems: list[ConfigProblem],
    extensions: dict[str, Any],
) -> Any:
    """An ``optimizer``/``scheduler`` block: resolve ``type``, then check the member's keys."""
    choices = ", ".join(members)
    type_path = join_path(path, "type")
    raw = value.get("type", MISSING)
    if raw is MISSING:
        problems.append(ConfigProblem.at(type_path, MISSING, f"is required; one of {choices}"))
        return _DROP
    by_lower = {tag.lower(): tag for tag in members}
    tag = by_lower.get(raw.lower()) if isinstance(raw, str) else None
    if tag is None:
        hint = did_you_mean(raw, members) if isinstance(raw, str) else ""
        problems.append(
            ConfigProblem.at(type_path, raw, f"not a type zstack provides{hint} (one of {choices})")
        )
        return _DROP
    return check_keys(members[tag], {**value, "type": tag}, path, problems, extensions)
