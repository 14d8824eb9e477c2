"""Config factories shared by the config tests: realistic DeepSpeed configs as dicts."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from zcore.config import ConfigError, ZConfig

# A ZeRO-3 config as DeepSpeed users write them (Hugging Face's zero3 example, with numbers
# in place of "auto" and the offload blocks left on the GPU).
STAGE3: dict[str, Any] = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "seed": 1234,
    "bf16": {"enabled": True},
    "fp16": {
        "enabled": False,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 3e-4,
            "warmup_num_steps": 500,
            "total_num_steps": 10000,
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "offload_param": {"device": "none", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 4.5e8,
        "stage3_param_persistence_threshold": 1e6,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "llama-7b"},
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1},
}


def stage3(**changes: Any) -> dict[str, Any]:
    """A deep copy of STAGE3 with top-level keys replaced (a value of None removes the key)."""
    config = copy.deepcopy(STAGE3)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def load_error(config: Any) -> ConfigError:
    """The ConfigError ZConfig.load raises for `config` (fails the test if none)."""
    with pytest.raises(ConfigError) as info:
        ZConfig.load(config)
    return info.value
