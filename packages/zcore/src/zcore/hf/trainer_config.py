"""A DeepSpeed config for :class:`zcore.hf.Trainer`: ``"auto"`` values from ``TrainingArguments``.

transformers' Trainer and the ZeRO config both say how large a batch is, how many micro-steps
accumulate, the learning rate, warm-up, clipping and precision. As transformers does for
DeepSpeed (``HfTrainerDeepSpeedConfig``), a value written ``"auto"`` is taken from the
arguments and a value written out must agree with them; every disagreement is reported at
once, naming both values, before anything is built. Unlike transformers, the keys the
Trainer's own loop depends on (micro-batch size, accumulation steps, train batch size,
clipping, fp16/bf16) are filled when the config leaves them out: the Trainer feeds the
batches, so a config that is silent on them means "as the arguments say".

Nothing here imports transformers: ``args`` is read by attribute (``per_device_train_batch_size``,
``gradient_accumulation_steps``, ``world_size``, ``max_grad_norm``, ``learning_rate``,
``adam_beta1``/``adam_beta2``, ``adam_epsilon``, ``weight_decay``, ``fp16``, ``bf16``,
``get_warmup_steps``).

With ``tensor_parallel.autotp_size`` T the batch arithmetic counts data-parallel ranks
(``world_size / T``): the T tensor-parallel ranks of one data rank train on the same batches.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

AUTO = "auto"


class TrainerConfigError(ValueError):
    """The config and ``TrainingArguments`` disagree, or the config cannot be used as given."""


def load_config(config: dict | str | os.PathLike[str]) -> dict[str, Any]:
    """A deep copy of ``config`` (a dict, or the path of a JSON file)."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise TrainerConfigError(
                f"config={str(config)!r} is not a file; pass a ZeRO config dict or the path "
                "of a JSON file (DeepSpeed's ds_config.json format)"
            )
        return json.loads(path.read_text())
    raise TrainerConfigError(
        f"config= is a {type(config).__name__}; pass a dict or the path of a JSON file"
    )


class _Filler:
    """Fills one config in place and collects the disagreements."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.mismatches: list[str] = []

    def _node(self, key: str) -> tuple[dict[str, Any] | None, str]:
        *parents, leaf = key.split(".")
        node: Any = self.config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, leaf
        return (node if isinstance(node, dict) else None), leaf

    def match(self, key: str, value: Any, arg: str, *, fill_missing: bool = False) -> None:
        """``"auto"`` (or absent, with ``fill_missing``) becomes ``value``; a written value
        must equal it."""
        node, leaf = self._node(key)
        if node is None:
            if fill_missing:
                self._create(key)[leaf] = value
            return
        if leaf not in node:
            if fill_missing:
                node[leaf] = value
            return
        if node[leaf] == AUTO:
            node[leaf] = value
        elif not _same(node[leaf], value):
            self.mismatches.append(
                f"config {key}={node[leaf]!r} vs TrainingArguments {arg}={value!r}"
            )

    def fill(self, key: str, value: Any) -> None:
        """``"auto"`` becomes ``value``; anything written stays."""
        node, leaf = self._node(key)
        if node is not None and node.get(leaf) == AUTO:
            node[leaf] = value

    def _create(self, key: str) -> dict[str, Any]:
        node = self.config
        for part in key.split(".")[:-1]:
            node = node.setdefault(part, {})
        return node

    def raise_if_mismatched(self) -> None:
        if self.mismatches:
            raise TrainerConfigError(
                "the ZeRO config and TrainingArguments disagree:\n- "
                + "\n- ".join(self.mismatches)
                + '\nset the config value to "auto" (it then follows TrainingArguments) or make '
                "the two equal"
            )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def tp_size(config: dict[str, Any]) -> int:
    """``tensor_parallel.autotp_size`` of ``config`` (1 without it; a bad value is left for
    the config's own check to name)."""
    block = config.get("tensor_parallel")
    size = block.get("autotp_size", 1) if isinstance(block, dict) else 1
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else 1


def data_world(config: dict[str, Any], args: Any) -> int:
    """The ranks that read different batches: ``args.world_size`` over the config's
    ``tensor_parallel.autotp_size`` (the ``tp`` ranks of one data rank share its batches)."""
    world, tp = int(args.world_size), tp_size(config)
    if world % tp:
        raise TrainerConfigError(
            f"tensor_parallel.autotp_size {tp} does not divide the world size {world} "
            f"({world} % {tp} = {world % tp}); launch a multiple of {tp} processes or set "
            f"autotp_size to a divisor of {world}"
        )
    return world // tp


def fill_from_args(config: dict[str, Any], args: Any) -> dict[str, Any]:
    """``config`` with every value ``TrainingArguments`` decides filled in and checked.

    Raises :class:`TrainerConfigError` listing every disagreement. Keys that depend on the
    model or the run's length stay ``"auto"`` until :func:`finalize`.
    """
    config = copy.deepcopy(config)
    f = _Filler(config)
    world = data_world(config, args)
    ranks = "world size" if world == int(args.world_size) else "data-parallel ranks"
    micro, gas = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    f.match(
        "train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", fill_missing=True
    )
    f.match("gradient_accumulation_steps", gas, "gradient_accumulation_steps", fill_missing=True)
    f.match(
        "train_batch_size",
        micro * gas * world,
        f"per_device_train_batch_size x gradient_accumulation_steps x {ranks} "
        f"({micro} x {gas} x {world})",
        fill_missing=True,
    )
    f.match("gradient_clipping", float(args.max_grad_norm), "max_grad_norm", fill_missing=True)
    f.match("optimizer.params.lr", args.learning_rate, "learning_rate")
    f.match("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    f.match("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    f.match("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    f.fill("scheduler.params.warmup_min_lr", 0)
    f.match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    f.match("fp16.enabled", bool(args.fp16), "fp16", fill_missing=True)
    f.match("bf16.enabled", bool(args.bf16), "bf16", fill_missing=True)
    f.raise_if_mismatched()
    if config["fp16"]["enabled"] and config["bf16"]["enabled"]:
        raise TrainerConfigError(
            "fp16.enabled and bf16.enabled are both true; pick one precision (TrainingArguments "
            "fp16=True or bf16=True, or the config's blocks)"
        )
    return config


def finalize(
    config: dict[str, Any], args: Any, hidden_size: int | None, num_training_steps: int | None
) -> dict[str, Any]:
    """``config`` with the model- and length-dependent ``"auto"`` values filled (as
    transformers fills them for DeepSpeed): bucket sizes from ``hidden_size``, the scheduler's
    ``total_num_steps`` and ``warmup_num_steps``. Raises :class:`TrainerConfigError` naming any
    ``"auto"`` left, or a disagreement.

    ``num_training_steps`` None (the run's length not known yet): the scheduler's ``"auto"``
    steps become 1 and written ones are not checked, for :func:`check` before training.
    """
    config = copy.deepcopy(config)
    f = _Filler(config)
    if hidden_size is not None:
        f.fill("zero_optimization.reduce_bucket_size", hidden_size * hidden_size)
        f.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden_size**2))
        f.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden_size)
    if num_training_steps is None:
        f.fill("scheduler.params.total_num_steps", 1)
        f.fill("scheduler.params.warmup_num_steps", 1)
    else:
        f.match("scheduler.params.total_num_steps", num_training_steps, "max_steps (calculated)")
        warmup = max(1, int(args.get_warmup_steps(num_training_steps)))
        f.match("scheduler.params.warmup_num_steps", warmup, "warmup_steps (calculated)")
    f.raise_if_mismatched()
    left = sorted(_auto_keys(config))
    if left:
        raise TrainerConfigError(
            f"config keys {left} are still 'auto': zcore.hf.Trainer fills only the keys "
            "TrainingArguments or the model decide; write a value for these"
        )
    return config


def _auto_keys(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _auto_keys(v, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if node == AUTO else []


def init_config(
    config: dict | str | os.PathLike[str], args: Any, hidden_size: int | None = None
) -> dict[str, Any]:
    """The Trainer's config with every ``"auto"`` filled, for building the model partitioned
    before the Trainer exists (``zcore.hf.from_pretrained(cls, path, ds_config=...)`` or
    ``zcore.zero.Init(config=...)``), as ``TrainingArguments(deepspeed=...)`` fills it for
    DeepSpeed's ``zero.Init``. ``hidden_size`` (the model config's) fills the bucket sizes and
    the stage-3 persistence threshold; the schedule's length is a placeholder here."""
    return finalize(fill_from_args(load_config(config), args), args, hidden_size, None)


def check(config: dict[str, Any], args: Any, hidden_size: int | None) -> None:
    """Parse the config as the engine will (every key, the optimizer and scheduler types, the
    batch arithmetic), before anything is built: raises ``zcore.config.ConfigError`` (a
    ``ValueError``) naming the key, the value and what is valid."""
    from zcore.config import ZConfig

    parsed = ZConfig.load(finalize(config, args, hidden_size, None))
    parsed.batch_sizes(data_world(config, args))
