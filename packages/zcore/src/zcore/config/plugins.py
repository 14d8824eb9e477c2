"""Finding what installed packages register with zcore, through Python entry points.

A package declares entry points in its ``pyproject.toml``; installing it is all a user
does. Two groups are read here:

- ``zcore.optimizers``: name = the optimizer ``type`` (matched ignoring case), value =
  ``module:attr``, an :class:`~zcore.config.OptimizerSpec` or a function returning one;
- ``zcore.config_blocks``: name = a top-level config key, value = ``module:attr``, a
  pydantic model class or a function ``raw block -> parsed block`` that raises
  ``ValueError`` naming the key (zquant's ``compression_training`` parser is one).

An entry point is loaded only when a config names it, so an unused plug-in costs
nothing. The listing is read from the installed distributions once per ``sys.path``.
"""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint, entry_points
from typing import Any

OPTIMIZERS_GROUP = "zcore.optimizers"
BLOCKS_GROUP = "zcore.config_blocks"

_listing: dict[tuple[str, tuple[str, ...]], dict[str, EntryPoint]] = {}


class PluginError(ValueError):
    """An entry point that names something that cannot be imported or is of the wrong kind."""


def discover(group: str) -> dict[str, EntryPoint]:
    """The entry points of ``group`` by name, as installed for the current ``sys.path``."""
    key = (group, tuple(sys.path))
    found = _listing.get(key)
    if found is None:
        found = {ep.name: ep for ep in entry_points(group=group)}
        _listing[key] = found
    return found


def find(group: str, name: str) -> EntryPoint | None:
    """The entry point of ``group`` called ``name``, ignoring case."""
    wanted = name.lower()
    for ep_name, ep in discover(group).items():
        if ep_name.lower() == wanted:
            return ep
    return None


def load(ep: EntryPoint) -> Any:
    """The object ``ep`` names; a :class:`PluginError` names the entry point when it fails."""
    try:
        return ep.load()
    except Exception as error:  # any import-time failure of a third-party module
        dist = f" (from {ep.dist.name})" if getattr(ep, "dist", None) else ""
        raise PluginError(
            f"entry point `{ep.name} = {ep.value}` of group {ep.group}{dist} failed to load: "
            f"{type(error).__name__}: {error}; reinstall or uninstall that package"
        ) from error
