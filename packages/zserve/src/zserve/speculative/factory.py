"""The drafter `EngineConfig.speculative` names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zserve.speculative.drafter import Drafter
from zserve.speculative.ngram import NgramDrafter
from zserve.speculative.self_draft import SelfDrafter

if TYPE_CHECKING:
    from zserve.config import EngineConfig


def make_drafter(config: EngineConfig, runner: Any) -> Drafter:
    """The drafter `config.speculative` names, over `runner` (the target's ModelRunner)."""
    if config.speculative == "ngram":
        return NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min)
    if config.speculative == "self-draft":
        if not hasattr(runner, "model") or not hasattr(runner, "kv_cache"):
            raise ValueError(
                f"speculative 'self-draft' needs a model runner with weights; "
                f"{type(runner).__name__} has none; use speculative 'ngram'"
            )
        layers = len(runner.model.layers)
        default = max(1, layers - max(1, layers // 8))
        return SelfDrafter(runner, config.draft_layers or default)
    raise ValueError(
        f"speculative {config.speculative!r} has no drafter; use 'ngram' or 'self-draft'"
    )
