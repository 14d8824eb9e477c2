"""Data efficiency: DeepSpeed's curriculum learning and random-LTD in zcore.

- :mod:`~zcore.data_efficiency.config`: the ``data_efficiency`` block and the legacy
  top-level ``curriculum_learning`` block (DeepSpeed's keys; ``ZConfig.load`` checks them,
  ``cfg.extension(key)`` returns them);
- :mod:`~zcore.data_efficiency.schedules`: ``fixed_linear``, ``fixed_root``,
  ``fixed_discrete`` and ``custom`` difficulty schedules;
- :mod:`~zcore.data_efficiency.analyzer`: per-sample metrics (``seqlen``,
  ``vocab_rarity``) computed once and saved as index files;
- :mod:`~zcore.data_efficiency.sampler`: the difficulty-driven sampler, resumable exactly;
- :mod:`~zcore.data_efficiency.curriculum`: what a training loop takes from a config;
- :mod:`~zcore.data_efficiency.random_ltd`: random-LTD on a model's middle layers (its keys
  in ``random_ltd_config``, schedule in ``random_ltd_schedule``, gather/scatter in
  ``token_routing``).

Names load on first use, so ``import zcore.data_efficiency`` stays cheap (and
``zcore.config`` can import the config models without importing the rest).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataEfficiencyConfig": "config",
    "LegacyCurriculumConfig": "config",
    "CurriculumMetricConfig": "config",
    "CurriculumScheduler": "schedules",
    "register_curriculum_schedule": "schedules",
    "unregister_curriculum_schedule": "schedules",
    "MetricIndex": "analyzer",
    "analyze": "analyzer",
    "seqlen": "analyzer",
    "vocab_rarity": "analyzer",
    "write_index": "analyzer",
    "CurriculumSampler": "sampler",
    "Curriculum": "curriculum",
    "truncate": "curriculum",
    "RandomLTD": "random_ltd",
    "find_layers": "random_ltd",
    "RandomLTDConfig": "random_ltd_config",
    "RandomLTDScheduler": "random_ltd_schedule",
    "gather_tokens": "token_routing",
    "scatter_tokens": "token_routing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zcore.data_efficiency' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zcore.data_efficiency.{module}"), name)
