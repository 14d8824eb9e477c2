"""DeepSpeed-compatible training config: pydantic models with DeepSpeed's keys,
names and defaults, checked at load with messages that name the key, the value
and the fix.

::

    from zcore.config import ZConfig, ConfigError
    cfg = ZConfig.load("ds_config.json")   # or a dict; raises ConfigError
    sizes = cfg.batch_sizes(world_size)      # BatchSizes(train, micro, accumulation, world)
    cfg.zero_optimization.stage, cfg.optimizer.params.model_dump()

Keys earlier DeepSpeed releases documented (``bfloat16``, ``cpu_offload``, ...) are
read under their current name with an :class:`OldKeyWarning` naming it
(:mod:`zcore.config.old_keys`). DeepSpeed features zstack does not build yet are rejected unless a package
that builds them has called :func:`register_feature`.

Other packages' own configs derive from :class:`ZModel` (unknown keys rejected, values
checked at construction, immutable), as zchat's stage configs do.

Top-level blocks other packages own (``compression_training`` with zquant
installed) are validated by the schema the package registers
(:func:`register_config_block`, or a ``zcore.config_blocks`` entry point) and
handed over by :meth:`ZConfig.extension`. Optimizer types come from a registry (:func:`register_optimizer`, or a
``zcore.optimizers`` entry point of an installed package): each names its params
model and its factory, see :class:`OptimizerSpec`.
"""

from zcore.config._base import ZModel
from zcore.config.batch import BatchSizes, resolve_batch_sizes
from zcore.config.blocks import (
    BlockSchema,
    config_block,
    register_config_block,
    registered_config_blocks,
    unregister_config_block,
)
from zcore.config.errors import ConfigError, ConfigProblem
from zcore.config.features import register_feature, registered_features, unregister_feature
from zcore.config.monitor import CSVMonitorConfig, MonitorConfig, TensorBoardConfig
from zcore.config.old_keys import OldKey, OldKeyWarning
from zcore.config.optim import (
    AdagradParams,
    AdamParams,
    LionParams,
    OptimizerConfig,
    OptimizerParams,
    SGDParams,
)
from zcore.config.optim_registry import (
    OptimizerSpec,
    optimizer_spec,
    optimizer_types,
    register_optimizer,
    unregister_optimizer,
)
from zcore.config.precision import BF16Config, DataTypesConfig, DtypeName, FP16Config
from zcore.config.root import ZConfig
from zcore.config.scheduler import (
    SCHEDULER_TYPES,
    OneCycleConfig,
    OneCycleParams,
    SchedulerConfig,
    WarmupCosineLRConfig,
    WarmupCosineLRParams,
    WarmupDecayLRConfig,
    WarmupDecayLRParams,
    WarmupLRConfig,
    WarmupLRParams,
)
from zcore.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "SCHEDULER_TYPES",
    "AdagradParams",
    "AdamParams",
    "BF16Config",
    "BatchSizes",
    "BlockSchema",
    "CSVMonitorConfig",
    "ConfigError",
    "ConfigProblem",
    "DataTypesConfig",
    "DtypeName",
    "FP16Config",
    "LionParams",
    "MonitorConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OldKey",
    "OldKeyWarning",
    "OneCycleConfig",
    "OneCycleParams",
    "OptimizerConfig",
    "OptimizerParams",
    "OptimizerSpec",
    "SGDParams",
    "SchedulerConfig",
    "TensorBoardConfig",
    "WarmupCosineLRConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRConfig",
    "WarmupDecayLRParams",
    "WarmupLRConfig",
    "WarmupLRParams",
    "ZConfig",
    "ZModel",
    "ZeroConfig",
    "config_block",
    "optimizer_spec",
    "optimizer_types",
    "register_config_block",
    "register_feature",
    "register_optimizer",
    "registered_config_blocks",
    "registered_features",
    "resolve_batch_sizes",
    "unregister_config_block",
    "unregister_feature",
    "unregister_optimizer",
]
