"""The names a checkpoint keys parameters by: the model's, or those it asks for.

A model may name its parameters differently in checkpoints (``checkpoint_names()``, see
:meth:`zcore.checkpoint.parts.ModelPart.checkpoint_names`): a pipelined GPT whose layers are
``layers.<i>.…`` saves them under the plain GPT's ``transformer.h.<j>.…``, so a checkpoint
of either loads into the other at any layout, and ``consolidate`` gives the plain model's
state dict. Everything a checkpoint writes (rank files' layouts, the parameter table,
``tp_cuts``, frozen parameters, buffers, aliases) uses these names; a load maps them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from zcore.zero.layout import GroupLayout


class Names:
    """A model's renaming (``to_saved``) and its inverse; the identity when empty."""

    def __init__(self, to_saved: Mapping[str, str]) -> None:
        self.to_saved = {k: v for k, v in to_saved.items() if k != v}
        self.to_model = {v: k for k, v in self.to_saved.items()}
        if len(self.to_model) != len(self.to_saved):
            twice = sorted(
                v for v in self.to_saved.values() if list(self.to_saved.values()).count(v) > 1
            )
            raise ValueError(
                f"checkpoint_names() gives several parameters the name {twice[0]!r}; "
                "give each parameter its own name"
            )

    def saved(self, name: str) -> str:
        return self.to_saved.get(name, name)

    def model(self, name: str) -> str:
        return self.to_model.get(name, name)

    def layouts(self, layouts: list[GroupLayout]) -> list[GroupLayout]:
        """``layouts`` with their parameters under their saved names."""
        if not self.to_saved:
            return layouts
        return [
            GroupLayout(tuple(replace(s, name=self.saved(s.name)) for s in g.shards), g.world)
            for g in layouts
        ]

    def keys(self, values: Mapping[str, Any], *, to_model: bool = False) -> dict[str, Any]:
        """``values`` keyed by saved names (``to_model``: by the model's names)."""
        rename = self.model if to_model else self.saved
        return {rename(k): v for k, v in values.items()}
