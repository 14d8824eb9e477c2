"""zcore.hf.Trainer's config: "auto" values from TrainingArguments, conflicts named with both
values, and bad input refused when the Trainer is built, before any training (one process,
no ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from zcore.config import ConfigError
from zcore.hf.trainer_config import TrainerConfigError, fill_from_args, finalize, load_config


def args(**kw: Any) -> SimpleNamespace:
    """What the config reads of TrainingArguments, with its defaults."""
    base = dict(
        world_size=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        learning_rate=5e-5,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        fp16=False,
        bf16=False,
        warmup_steps=3,
    )
    base.update(kw)
    ns = SimpleNamespace(**base)
    ns.get_warmup_steps = lambda steps: ns.warmup_steps
    return ns


def test_auto_values_come_from_the_arguments() -> None:
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"},
    }
    filled = fill_from_args(config, args(bf16=True, learning_rate=1e-4))
    assert config["train_batch_size"] == "auto"  # the caller's dict is left alone
    assert filled["train_micro_batch_size_per_gpu"] == 4
    assert filled["gradient_accumulation_steps"] == 2
    assert filled["train_batch_size"] == 4 * 2 * 2
    assert filled["gradient_clipping"] == 1.0
    assert filled["bf16"] == {"enabled": True} and filled["fp16"] == {"enabled": False}
    assert filled["optimizer"]["params"] == {
        "lr": 1e-4,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    done = finalize(filled, args(), hidden_size=64, num_training_steps=20)
    assert done["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 1e-4,
        "warmup_num_steps": 3,
        "total_num_steps": 20,
    }
    assert done["zero_optimization"]["stage3_param_persistence_threshold"] == 640


def test_keys_the_loop_depends_on_are_filled_when_missing() -> None:
    filled = fill_from_args({"zero_optimization": {"stage": 2}}, args(max_grad_norm=0.5))
    assert filled["train_micro_batch_size_per_gpu"] == 4
    assert filled["gradient_accumulation_steps"] == 2
    assert filled["train_batch_size"] == 16
    assert filled["gradient_clipping"] == 0.5
    assert "optimizer" not in filled and "scheduler" not in filled  # the Trainer's own are used


def test_every_conflict_is_named_with_both_values() -> None:
    config = {
        "gradient_accumulation_steps": 4,
        "train_batch_size": 64,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    with pytest.raises(TrainerConfigError) as err:
        fill_from_args(config, args())
    text = str(err.value)
    assert (
        "config gradient_accumulation_steps=4 vs TrainingArguments gradient_accumulation_steps=2"
        in text
    )
    assert "config train_batch_size=64 vs TrainingArguments per_device_train_batch_size" in text
    assert "(4 x 2 x 2)" in text
    assert "config optimizer.params.lr=0.001 vs TrainingArguments learning_rate=5e-05" in text
    assert '"auto"' in text  # the fix


def test_equal_values_written_out_are_accepted() -> None:
    config = {"train_batch_size": 16, "gradient_clipping": 1, "fp16": {"enabled": False}}
    assert fill_from_args(config, args())["train_batch_size"] == 16


def test_a_written_schedule_length_must_match_the_run() -> None:
    config = {"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}}
    with pytest.raises(
        TrainerConfigError, match=r"total_num_steps=10 vs .* max_steps \(calculated\)=20"
    ):
        finalize(config, args(), None, 20)


def test_an_auto_nobody_fills_is_named() -> None:
    config = {"zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}}
    with pytest.raises(TrainerConfigError, match=r"zero_optimization.allgather_bucket_size"):
        finalize(config, args(), 64, 10)


def test_both_precisions_are_refused() -> None:
    with pytest.raises(TrainerConfigError, match=r"fp16\.enabled and bf16\.enabled are both true"):
        fill_from_args({"fp16": {"enabled": "auto"}}, args(bf16=True, fp16=True))


def test_the_config_for_building_the_model_partitioned_has_no_auto_left() -> None:
    from zcore.hf import init_config

    config = {
        "train_batch_size": "auto",
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    }
    filled = init_config(config, args(), hidden_size=64)
    assert filled["train_batch_size"] == 16
    assert filled["zero_optimization"]["stage3_param_persistence_threshold"] == 640
    with pytest.raises(TrainerConfigError, match="stage3_param_persistence_threshold"):
        init_config(config, args())  # no hidden size: that "auto" cannot be filled


def test_config_from_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert load_config(path) == {"zero_optimization": {"stage": 1}}
    with pytest.raises(TrainerConfigError, match="is not a file"):
        load_config(tmp_path / "missing.json")


# -- the Trainer refuses bad input when it is built -------------------------------------------
def _trainer(tmp_path: Path, config: Any, **arg_overrides: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    import zcore.hf
    from tests.zcore.hf.trainer_common import dataset, training_args

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    targs = training_args(tmp_path, 2, **arg_overrides)
    return zcore.hf.Trainer(model=model, args=targs, train_dataset=dataset(8), config=config)


def test_deepspeed_as_well_is_refused(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    import zcore.hf

    # TrainingArguments(deepspeed=...) imports deepspeed, which is not installed here: set the
    # field afterwards, as it reads once deepspeed is installed
    targs = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    targs.deepspeed = "ds_config.json"
    with pytest.raises(TrainerConfigError, match=r"deepspeed='ds_config.json'.*drop deepspeed="):
        zcore.hf.Trainer(model=None, args=targs, config={"zero_optimization": {"stage": 2}})


def test_a_missing_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TrainerConfigError, match="needs config="):
        _trainer(tmp_path, None)


def test_a_conflict_fails_before_training(tmp_path: Path) -> None:
    with pytest.raises(TrainerConfigError, match="gradient_accumulation_steps=8 vs"):
        _trainer(tmp_path, {"gradient_accumulation_steps": 8})


def test_an_optimizer_the_config_cannot_build_fails_before_training(tmp_path: Path) -> None:
    config = {"optimizer": {"type": "Adafactor", "params": {"lr": "auto"}}}
    with pytest.raises(ConfigError, match=r'optimizer.type = "Adafactor".*registered: .*AdamW'):
        _trainer(tmp_path, config)


def test_an_epoch_of_partial_accumulation_fails_before_training(tmp_path: Path) -> None:
    from tests.zcore.hf.trainer_common import dataset

    trainer = _trainer(tmp_path, {"zero_optimization": {"stage": 2}}, num_train_epochs=2)
    trainer.train_dataset = dataset(10)  # 5 micro-batches of 2 per epoch, accumulation 2
    with pytest.raises(TrainerConfigError, match=r"5 micro-batches .* multiple of 4 rows"):
        trainer.train()
    assert trainer.engine is None  # nothing was built


def test_import_zcore_hf_does_not_import_transformers() -> None:
    code = "import sys, zcore.hf; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_load_best_with_save_only_model_is_refused(tmp_path: Path) -> None:
    ov = {"eval_strategy": "steps", "save_strategy": "steps", "load_best_model_at_end": True}
    with pytest.raises(
        TrainerConfigError, match=r"save_only_model=True.*set save_only_model=False"
    ):
        _trainer(tmp_path, {"zero_optimization": {"stage": 2}}, save_only_model=True, **ov)
