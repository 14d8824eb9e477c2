"""The config-block registry: a top-level ds_config key owned by another package -> its schema.

A package that reads its own block of a DeepSpeed config (zquant's
``compression_training``, a plug-in's settings) declares it, and installing the package
is then enough for ``ZConfig.load`` to accept and validate the block::

    [project.entry-points."zcore.config_blocks"]
    compression_training = "zquant.compression.config:load_compression_config"

The schema is either a pydantic model class (its unknown keys get the same did-you-mean
as zcore's blocks, its values the same messages), or, for a package that does not
depend on pydantic or zcore, a function ``raw block -> parsed block`` that raises
``ValueError`` whose message names the key. The parsed block is handed over by
:meth:`ZConfig.extension`. :func:`register_config_block` registers one in-process.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from zcore.config import plugins
from zcore.config._convert import problems_from
from zcore.config.errors import ConfigProblem

#: A pydantic model class, or ``parse(raw block) -> parsed block`` raising ``ValueError``.
BlockSchema = type[BaseModel] | Callable[[Any], Any]

_schemas: dict[str, BlockSchema] = {}

#: Blocks zcore owns outside ``zcore.config``, imported when a config first names them (so
#: loading ``zcore.config`` does not import them): key -> ``"module:attr"``.
_ZCORE_BLOCKS: dict[str, str] = {
    "data_efficiency": "zcore.data_efficiency.config:DataEfficiencyConfig",
    "curriculum_learning": "zcore.data_efficiency.config:LegacyCurriculumConfig",
    "scala": "zcore.scala.config:ScalaConfig",
    "pipeline": "zcore.pipe.config:PipelineConfig",
    "tensor_parallel": "zcore.tensor.config:TensorParallelConfig",
}


def register_config_block(key: str, schema: BlockSchema, *, replace: bool = False) -> None:
    """Validate the top-level key ``key`` with ``schema``; registering a different schema
    under a taken key is an error unless ``replace``."""
    if not isinstance(key, str) or not key.isidentifier():
        raise ValueError(f"register_config_block: key must be an identifier, got {key!r}")
    if not _is_schema(schema):
        raise TypeError(
            f"register_config_block({key!r}): schema must be a pydantic model class or a "
            f"function, got {schema!r}"
        )
    old = _schemas.get(key)
    if old is not None and old is not schema and not replace:
        raise ValueError(
            f"config block {key!r} is already registered ({_name(old)}); pass replace=True "
            "to override it"
        )
    _schemas[key] = schema


def unregister_config_block(key: str) -> None:
    """Forget the block ``key`` (tests, mostly); unknown keys are ignored."""
    _schemas.pop(key, None)


def registered_config_blocks() -> list[str]:
    """The keys registered in-process or declared by an installed package."""
    return sorted({*_schemas, *_ZCORE_BLOCKS, *plugins.discover(plugins.BLOCKS_GROUP)})


def config_block(key: str) -> BlockSchema | None:
    """The schema of ``key``, loading the installed package's entry point on first use;
    None when no package registers the key. Raises :class:`~zcore.config.plugins.PluginError`
    when the entry point does not load or names something else than a schema."""
    schema = _schemas.get(key)
    if schema is not None:
        return schema
    if key in _ZCORE_BLOCKS:
        module, _, attr = _ZCORE_BLOCKS[key].partition(":")
        schema = _schemas[key] = getattr(importlib.import_module(module), attr)
        return schema
    ep = plugins.discover(plugins.BLOCKS_GROUP).get(key)
    if ep is None:
        return None
    schema = plugins.load(ep)
    if not _is_schema(schema):
        raise plugins.PluginError(
            f"entry point `{ep.name} = {ep.value}` of group {ep.group} must name a pydantic "
            f"model class or a function, got {type(schema).__name__}"
        )
    _schemas[key] = schema
    return schema


@dataclass(frozen=True)
class FoundBlock:
    """A registered block met by the key pass: its schema and the value to validate."""

    schema: BlockSchema
    value: Any
    """As written, keys already checked for a pydantic schema."""


def parse_block(key: str, found: FoundBlock) -> tuple[Any, list[ConfigProblem]]:
    """The parsed block and the problems with it (the parsed block is None when any)."""
    schema = found.schema
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        try:
            return schema.model_validate(found.value), []
        except ValidationError as error:
            return None, problems_from(error, schema, key)
    try:
        return schema(found.value), []
    except ValueError as error:
        message = str(error)
        if not message.startswith(key):
            message = f"{key}: {message}"
        return None, [ConfigProblem(key, message, found.value)]


def dump_block(parsed: Any, raw: Any) -> Any:
    """The block as ``ZConfig.to_dict`` gives it: a pydantic block normalized (defaults
    filled in), any other as written."""
    if isinstance(parsed, BaseModel):
        return parsed.model_dump(mode="json", by_alias=True)
    return raw


def _is_schema(schema: Any) -> bool:
    if isinstance(schema, type):
        return issubclass(schema, BaseModel) and schema is not BaseModel
    return callable(schema)


def _name(schema: BlockSchema) -> str:
    return f"{getattr(schema, '__module__', '?')}.{getattr(schema, '__qualname__', schema)}"
