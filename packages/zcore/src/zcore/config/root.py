""":class:`ZConfig`, the whole training config, and :meth:`ZConfig.load`.

Loading runs in two passes so every problem is reported at once: the key pass
(:mod:`zcore.config._keys`) rejects unknown keys and gated features, then
pydantic checks the values, and its errors are converted into the same
:class:`~zcore.config.errors.ConfigProblem` lines. Either way the caller sees
one :class:`~zcore.config.errors.ConfigError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationError, ValidationInfo, field_validator

from zcore.config._base import Bool, Float, Int, ZModel, empty_block
from zcore.config._convert import problems_from
from zcore.config._keys import check_keys
from zcore.config.aio import AioConfig
from zcore.config.batch import BatchSizes, resolve_batch_sizes
from zcore.config.blocks import FoundBlock, dump_block, parse_block
from zcore.config.errors import ConfigError, ConfigProblem, problem_at
from zcore.config.monitor import CSVMonitorConfig, TensorBoardConfig
from zcore.config.old_keys import OldKey
from zcore.config.optim import OptimizerConfig
from zcore.config.precision import (
    BF16Config,
    DataTypesConfig,
    DtypeName,
    FP16Config,
    precision_of,
)
from zcore.config.scheduler import SchedulerConfig
from zcore.config.zero import ZeroConfig


class ZConfig(ZModel):
    """A DeepSpeed-style training config: DeepSpeed's keys, names and defaults.

    Build one with :meth:`load`; every block is immutable (use ``model_copy``).
    """

    aliases: ClassVar[dict[str, OldKey]] = {
        "bfloat16": OldKey("bf16", "runtime/constants.py: BFLOAT16_OLD, kept for compatibility")
    }

    train_batch_size: Int | None = Field(None, ge=1)
    """Samples per optimizer step over all data-parallel ranks."""
    train_micro_batch_size_per_gpu: Int | None = Field(None, ge=1)
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: Int | None = Field(None, ge=1)
    """Micro-batches accumulated before each optimizer step."""
    gradient_clipping: Float = Field(0.0, ge=0)
    """Clip the global gradient norm to this; 0 turns clipping off."""
    steps_per_print: Int = Field(10, ge=1)
    """Log progress every this many optimizer steps."""
    wall_clock_breakdown: Bool = False
    """Time forward, backward and step separately and log the times."""
    prescale_gradients: Bool = False
    """Divide gradients by ``gradient_predivide_factor`` before the all-reduce."""
    gradient_predivide_factor: Float = Field(1.0, gt=0)
    """Factor gradients are divided by before the all-reduce (the rest after)."""
    seed: Int | None = Field(None, ge=0)
    """Random seed for torch, numpy and Python on every rank; None leaves them alone."""
    sequence_parallel_size: Int = Field(1, ge=1)
    """Ranks that share each sequence, each holding a consecutive slice (Ulysses; the
    mesh's ``cp`` axis, inside the ZeRO axis: see :mod:`zcore.sequence`)."""
    sequence_parallel_mode: Literal["ulysses", "ring", "auto"] = "auto"
    """zstack: how attention sees the whole sequence across the ``cp`` ranks: ``ulysses``
    (all-to-all over heads), ``ring`` (key/value blocks passed around; any head count) or
    ``auto``: Ulysses where the query heads divide over ``cp``, the ring where they do not
    and the attention is plain softmax attention (:class:`~zcore.sequence.DistributedAttention`'s
    ``ring_ok``, as in Hugging Face models), Ulysses otherwise.
    :class:`~zcore.sequence.DistributedAttention` layers built without ``mode`` take it;
    under ``auto`` a layer built with a mode keeps it."""
    comm_timeout_s: Float = Field(1800.0, gt=0)
    """zstack: seconds before a collective that never completes ends the job."""
    fp16: FP16Config = Field(default_factory=empty_block)
    """float16 mixed precision."""
    bf16: BF16Config = Field(default_factory=empty_block)
    """bfloat16 mixed precision (DeepSpeed also reads the block as ``bfloat16``)."""
    data_types: DataTypesConfig = Field(default_factory=empty_block)
    """Dtypes of buffers other than the parameters'."""
    communication_data_type: DtypeName | None = None
    """Dtype gradients are communicated in; None uses the training dtype."""
    optimizer: OptimizerConfig | None = None
    """The optimizer; None when the caller passes its own to the engine."""
    scheduler: SchedulerConfig | None = None
    """The learning-rate schedule; None for a constant learning rate."""
    zero_optimization: ZeroConfig = Field(default_factory=empty_block)
    """ZeRO partitioning and offload."""
    aio: AioConfig | None = None
    """Async file IO of NVMe offload (DeepSpeed's block; unlocked by zoffload)."""
    tensorboard: TensorBoardConfig = Field(default_factory=empty_block)
    """TensorBoard monitor."""
    csv_monitor: CSVMonitorConfig = Field(default_factory=empty_block)
    """CSV monitor."""

    _extensions: dict[str, Any] = PrivateAttr(default_factory=dict)
    _blocks: dict[str, Any] = PrivateAttr(default_factory=dict)

    @field_validator("bf16")
    @classmethod
    def _one_precision(cls, value: BF16Config, info: ValidationInfo) -> BF16Config:
        fp16 = info.data.get("fp16")
        if value.enabled and fp16 is not None and fp16.enabled:
            raise problem_at(
                "enabled",
                True,
                "fp16.enabled and bf16.enabled are both true; enable one mixed-precision mode",
            )
        return value

    # -- loading ------------------------------------------------------------

    @classmethod
    def load(cls, source: Mapping[str, Any] | str | os.PathLike[str]) -> ZConfig:
        """A checked config from a dict, a JSON file path, or JSON text (a string starting
        with ``{``). Raises :class:`ConfigError` listing every problem."""
        where: str | None = None
        if isinstance(source, Mapping):
            data: Any = source
        elif isinstance(source, str) and source.lstrip().startswith("{"):
            data = _parse_json(source, "<config text>")
        elif isinstance(source, str | os.PathLike):
            where = os.fspath(source)
            data = _read_json(where)
        else:
            raise TypeError(
                f"ZConfig.load takes a dict or a JSON file path, got {type(source).__name__}"
            )
        if not isinstance(data, Mapping):
            raise ConfigError(
                [ConfigProblem("", f"the config must be a JSON object, got {type(data).__name__}")],
                where,
            )
        return cls._from_mapping(data, where)

    @classmethod
    def _from_mapping(cls, data: Mapping[str, Any], where: str | None) -> ZConfig:
        problems: list[ConfigProblem] = []
        extensions: dict[str, Any] = {}
        cleaned = check_keys(cls, dict(data), "", problems, extensions)
        config: ZConfig | None = None
        try:
            config = cls.model_validate(cleaned)
        except ValidationError as error:
            problems += problems_from(error, cls)
        parsed: dict[str, Any] = {}
        for key, found in extensions.items():
            if isinstance(found, FoundBlock):
                parsed[key], block_problems = parse_block(key, found)
                extensions[key] = dump_block(parsed[key], found.value)
                problems += block_problems
        if problems or config is None:
            raise ConfigError(problems, where)
        config._extensions = extensions
        config._blocks = parsed
        return config

    # -- derived values -------------------------------------------------------

    def batch_sizes(self, world_size: int) -> BatchSizes:
        """The three batch sizes for ``world_size`` data-parallel ranks (ConfigError when the
        config's sizes do not fit it)."""
        return resolve_batch_sizes(
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            world_size,
        )

    @property
    def precision(self) -> DtypeName:
        """The training dtype: ``"fp16"``, ``"bf16"`` or ``"fp32"``."""
        return precision_of(self.fp16, self.bf16)

    def extension(self, key_path: str) -> Any:
        """A block another package owns: for a registered block (``compression_training``
        with zquant installed, see :mod:`zcore.config.blocks`) what its schema parsed (a
        model instance); for a key unlocked with ``register_feature`` that zcore has no
        field for, the value as written. None when the config does not give it."""
        if key_path in self._blocks:
            return self._blocks[key_path]
        return self._extensions.get(key_path)

    def to_dict(self) -> dict[str, Any]:
        """The normalized config as JSON-ready data (every key, defaults filled in), for
        checkpoint manifests; ``ZConfig.load(cfg.to_dict())`` gives an equal config."""
        out = self.model_dump(mode="json")
        for path, value in self._extensions.items():
            *parents, last = path.split(".")
            block = out
            for key in parents:
                block = block.setdefault(key, {})
            block[last] = value
        return out


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(
            [ConfigProblem("", f"config file `{path}` does not exist; pass a JSON config's path")]
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ConfigError([ConfigProblem("", f"cannot read config file `{path}`: {why}")]) from None
    return _parse_json(text, path)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(Exception):
    pass


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as error:
        raise ConfigError(
            [
                ConfigProblem(
                    "",
                    f"{where}: invalid JSON at line {error.lineno}, column {error.colno}: "
                    f"{error.msg}",
                )
            ]
        ) from None
    except _DuplicateKey as error:
        raise ConfigError(
            [
                ConfigProblem(
                    "",
                    f"{where}: key `{error.args[0]}` appears twice in one JSON object; "
                    "keep one (DeepSpeed rejects duplicates too)",
                )
            ]
        ) from None
