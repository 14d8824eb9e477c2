"""The data_efficiency and legacy curriculum_learning blocks load through ZConfig.load with
DeepSpeed's keys, and bad values fail at load naming the key and the fix."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from zcore.config import ConfigError, OldKeyWarning, ZConfig
from zcore.data_efficiency import DataEfficiencyConfig, LegacyCurriculumConfig

# DeepSpeed's Data Efficiency tutorial shape (GPT pre-training, a vocabulary-rarity metric
# by percentile and a seqlen_truncate metric tracked only), with paths of our own.
DE: dict[str, Any] = {
    "train_batch_size": 8,
    "data_efficiency": {
        "enabled": True,
        "seed": 1234,
        "data_routing": {"enabled": False, "random_ltd": {"enabled": False, "total_layer_num": 4}},
        "data_sampling": {
            "enabled": True,
            "num_epochs": 1,
            "num_workers": 0,
            "curriculum_learning": {
                "enabled": True,
                "data_cluster_path": "/tmp/clusters",
                "curriculum_metrics": {
                    "vocab_rarity": {
                        "index_to_sample_path": "/tmp/r_index_to_sample.npy",
                        "index_to_metric_path": "/tmp/r_index_to_metric.npy",
                        "difficulty_type": "percentile",
                        "clustering_type": "schedule_based",
                        "min_difficulty": 1,
                        "max_difficulty": 100,
                        "schedule_type": "fixed_root",
                        "schedule_config": {
                            "total_curriculum_step": 100,
                            "difficulty_step": 1,
                            "root_degree": 2,
                        },
                    },
                    "seqlen_truncate": {
                        "difficulty_type": "value",
                        "clustering_type": "single_cluster",
                        "min_difficulty": 80,
                        "max_difficulty": 2048,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8},
                    },
                },
            },
        },
    },
}
LEGACY: dict[str, Any] = {
    "train_batch_size": 8,
    "curriculum_learning": {
        "enabled": True,
        "curriculum_type": "seqlen",
        "min_difficulty": 8,
        "max_difficulty": 1024,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 15000, "difficulty_step": 8},
    },
}


def _errors(config: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        ZConfig.load(config)
    return str(info.value)


def _with(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(base)
    *parents, last = path.split(".")
    block = out
    for key in parents:
        block = block[key]
    if value is None:
        del block[last]
    else:
        block[last] = value
    return out


def test_deepspeed_shaped_blocks_load_and_round_trip() -> None:
    cfg = ZConfig.load(DE)
    de = cfg.extension("data_efficiency")
    assert isinstance(de, DataEfficiencyConfig) and de.curriculum is not None
    assert de.curriculum.curriculum_metrics["vocab_rarity"].schedule_config.root_degree == 2
    assert ZConfig.load(cfg.to_dict()).extension("data_efficiency") == de
    legacy = ZConfig.load(LEGACY).extension("curriculum_learning")
    assert isinstance(legacy, LegacyCurriculumConfig) and legacy.max_difficulty == 1024


_CL = "data_efficiency.data_sampling.curriculum_learning"
_RARITY = f"{_CL}.curriculum_metrics.vocab_rarity"


@pytest.mark.parametrize(
    ("base", "path", "value", "expected"),
    [
        (
            LEGACY,
            "curriculum_learning.max_difficulty",
            4,
            "curriculum_learning.max_difficulty = 4: is below min_difficulty 8",
        ),
        (
            LEGACY,
            "curriculum_learning.min_difficulty",
            12,
            "is not a multiple of schedule_config.difficulty_step 8",
        ),
        (
            LEGACY,
            "curriculum_learning.curriculum_type",
            "vocab",
            'curriculum_learning.curriculum_type = "vocab"',
        ),
        (LEGACY, "curriculum_learning.schedule_type", "fixed_rot", "fixed_root"),
        (
            LEGACY,
            "curriculum_learning.schedule_config.difficulty_stp",
            8,
            "unknown key curriculum_learning.schedule_config.difficulty_stp; did you mean difficulty_step?",
        ),
        (
            LEGACY,
            "curriculum_learning.schedule_config.total_curriculum_step",
            None,
            "curriculum_learning.schedule_config.total_curriculum_step: is required by schedule_type 'fixed_linear'",
        ),
        (
            DE,
            f"{_RARITY}.max_difficulty",
            0,
            f"{_RARITY}.max_difficulty = 0: is below min_difficulty 1",
        ),
        (
            DE,
            f"{_RARITY}.index_to_sample_path",
            None,
            f"{_RARITY}.index_to_sample_path: is required",
        ),
        (DE, f"{_RARITY}.difficulty_type", "rank", f'{_RARITY}.difficulty_type = "rank"'),
        (DE, f"{_RARITY}.sample_path", "x", f"unknown key {_RARITY}.sample_path"),
        (
            DE,
            "data_efficiency.data_sampling.enabled",
            False,
            "data_efficiency.data_sampling.enabled = false: is false but data_sampling.curriculum_learning.enabled is true",
        ),
        (
            DE,
            "data_efficiency.data_routing.random_ltd.enabled",
            True,
            "data_efficiency.data_routing.random_ltd.random_ltd_layer_num: is required",
        ),
        (DE, f"{_CL}.curriculum_metrics", {}, "curriculum learning is enabled but names no metric"),
    ],
)
def test_bad_values_name_the_key(base: dict, path: str, value: Any, expected: str) -> None:
    assert expected in _errors(_with(base, path, value))


def test_fixed_discrete_lengths_and_order_are_checked() -> None:
    discrete = _with(LEGACY, "curriculum_learning.schedule_type", "fixed_discrete")
    sc = "curriculum_learning.schedule_config"
    bad = _with(discrete, sc, {"difficulty": [8, 16, 32], "max_step": [10]})
    assert "has 1 elements; fixed_discrete needs one fewer than difficulty (3)" in _errors(bad)
    bad = _with(discrete, sc, {"difficulty": [8, 16, 32], "max_step": [10, 5]})
    assert f"{sc}.max_step = [10, 5]: must increase" in _errors(bad)
    ZConfig.load(_with(discrete, sc, {"difficulty": [8, 16, 32], "max_step": [5, 10]}))


def test_disabled_legacy_block_needs_nothing_and_old_total_step_is_read() -> None:
    ZConfig.load({"train_batch_size": 8, "curriculum_learning": {"enabled": False}})
    old = _with(LEGACY, "curriculum_learning.schedule_config.total_curriculum_step", None)
    old["curriculum_learning"]["schedule_config"]["total_step"] = 300
    with pytest.warns(OldKeyWarning, match="total_curriculum_step"):
        cfg = ZConfig.load(old)
    assert cfg.extension("curriculum_learning").schedule_config.total_curriculum_step == 300
