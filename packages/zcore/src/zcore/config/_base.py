"""The base model every config block derives from, the scalar types they share,
and the introspection the key checker and the error converter walk by.

JSON configs are read leniently where DeepSpeed is (``5e8`` for an integer
count) and strictly where leniency hides mistakes: ``true`` is not a number
and ``"16"`` is neither a number nor a boolean.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar, Union

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from zcore.config.errors import AUTO_HINT, ValueProblem
from zcore.config.old_keys import NOTHING, OldKey


class ZModel(BaseModel):
    """A config block: unknown keys rejected, values checked at construction, immutable.

    Change a loaded config with ``model_copy(update=...)``.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,
        validate_default=True,
    )

    #: Keys earlier DeepSpeed releases documented, as {old key: OldKey}
    #: (:mod:`zcore.config.old_keys`); ``ZConfig.load`` warns when it reads one.
    aliases: ClassVar[dict[str, OldKey]] = {}

    @model_validator(mode="before")
    @classmethod
    def _rename_aliases(cls, data: Any) -> Any:
        """Old keys read under their current name, silently (the key pass warns); an old key
        given next to its current one is left for validation to reject."""
        if not cls.aliases or not isinstance(data, dict):
            return data
        renamed = dict(data)
        for old, entry in cls.aliases.items():
            if old in data and entry.new not in data:
                value = entry.value(renamed.pop(old))
                if value is not NOTHING:
                    renamed[entry.new] = value
        return renamed

    @classmethod
    def dynamic_blocks(cls, data: Mapping[str, Any]) -> dict[str, type[BaseModel]]:
        """Fields whose model depends on the block's other keys (``optimizer.params`` on
        ``type``), as {field: model} for ``data``; raise ValueProblem when it cannot be told."""
        return {}


class NestedProblems(ValueError):
    """Raised by a validator that validated sub-key ``key`` with another model: the
    converter reports each of ``error``'s problems at its own path under ``key``."""

    def __init__(self, error: ValidationError, model: type[BaseModel], key: str) -> None:
        super().__init__(str(error))
        self.error = error
        self.model = model
        self.key = key


def empty_block() -> Any:
    """Default of a block field: ``{}``, validated like a block written empty, so a block
    with required keys reports them by name when left out."""
    return {}


def _reject_bool_and_str(kind: str) -> Any:
    def check(value: Any) -> Any:
        if isinstance(value, bool | str):
            raise ValueProblem(f"must be {kind}" + (AUTO_HINT if value == "auto" else ""))
        return value

    return BeforeValidator(check)


Int = Annotated[int, _reject_bool_and_str("an integer")]
"""An integer; integral floats such as ``5e8`` are accepted (DeepSpeed configs write sizes so)."""
Float = Annotated[float, _reject_bool_and_str("a number")]
"""A finite number."""
Bool = StrictBool
"""``true`` or ``false`` only."""


class TypedBlock(ZModel):
    """A block selected by its ``type`` (``optimizer``, ``scheduler``); ``type`` is matched
    case-insensitively and stored in the canonical spelling of its ``Literal``."""

    @field_validator("type", mode="before", check_fields=False)
    @classmethod
    def _canonical_type(cls, value: Any) -> Any:
        tag = block_tag(cls)
        if isinstance(value, str) and tag is not None and value.lower() == tag.lower():
            return tag
        return value


def type_discriminator(tags: Iterable[str]) -> Discriminator:
    """Selects the member of a ``TypedBlock`` union by its ``type``, ignoring case."""
    by_lower = {t.lower(): t for t in tags}

    def tag(value: Any) -> str | None:
        raw = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return by_lower.get(raw.lower()) if isinstance(raw, str) else None

    return Discriminator(tag)


# -- introspection -------------------------------------------------------------


def _strip(annotation: Any) -> Any:
    """Drop ``Annotated[...]`` and ``None`` from an annotation (``X | None`` -> ``X``)."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _strip(members[0])
    return annotation


def block_tag(cls: type[BaseModel]) -> str | None:
    """The ``type`` a ``TypedBlock`` answers to (the single value of its ``Literal``)."""
    field = cls.model_fields.get("type")
    if field is None:
        return None
    args = typing.get_args(field.annotation)
    return args[0] if len(args) == 1 and isinstance(args[0], str) else None


def tagged_members(annotation: Any) -> dict[str, type[TypedBlock]] | None:
    """``{type: model}`` when ``annotation`` is a union of TypedBlocks, else None."""
    annotation = _strip(annotation)
    if typing.get_origin(annotation) not in (Union, types.UnionType):
        return None
    members: dict[str, type[TypedBlock]] = {}
    for member in typing.get_args(annotation):
        member = _strip(member)
        if not (isinstance(member, type) and issubclass(member, TypedBlock)):
            return None
        tag = block_tag(member)
        if tag is None:
            return None
        members[tag] = member
    return members


def model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``X`` or ``X | None``), else None."""
    annotation = _strip(annotation)
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation if is_model and annotation is not BaseModel else None


def old_names(cls: type[BaseModel]) -> dict[str, OldKey]:
    """``cls.aliases`` for a ZModel: {old DeepSpeed key: OldKey}; {} for other models."""
    return cls.aliases if issubclass(cls, ZModel) else {}


def key_names(cls: type[BaseModel]) -> dict[str, str]:
    """{key a user may write: field name}: field names and pydantic aliases (the spellings
    a plug-in's own model accepts); old DeepSpeed names are in :func:`old_names`."""
    names: dict[str, str] = {}
    for name, field in cls.model_fields.items():
        names[name] = name
        for alias in (field.alias, field.validation_alias):
            if isinstance(alias, str):
                names[alias] = name
            elif isinstance(alias, AliasChoices):
                names.update({c: name for c in alias.choices if isinstance(c, str)})
    return names


def forbids_extra(cls: type[BaseModel]) -> bool:
    """Whether the model rejects keys it has no field for (every ZModel does)."""
    return cls.model_config.get("extra") == "forbid"


def accepted_keys(cls: type[BaseModel]) -> list[str]:
    """The keys to suggest for a block: field names and their aliases (old DeepSpeed names
    are read too, but never suggested)."""
    return [k for k in key_names(cls) if k not in old_names(cls)]


def field_at(
    root: type[BaseModel], loc: tuple[str | int, ...]
) -> tuple[list[str | int], FieldInfo | None]:
    """Follow a pydantic error location from ``root``: the path a user wrote (union tags
    removed) and the field it ends on, when it ends on one."""
    path: list[str | int] = []
    model: type[BaseModel] | None = root
    field: FieldInfo | None = None
    items = list(loc)
    while items:
        item = items.pop(0)
        path.append(item)
        field = None
        name = key_names(model).get(item) if model is not None and isinstance(item, str) else None
        if model is None or name is None:
            model = None
            continue
        field = model.model_fields[name]
        members = tagged_members(field.annotation)
        if members is not None:
            model = None
            if items and items[0] in members:
                model = members[str(items.pop(0))]
        else:
            model = model_of(field.annotation)
    return path, field
