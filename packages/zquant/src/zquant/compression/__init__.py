"""DeepSpeed-style compression training: config, composer and scheduler."""

from zquant.compression.composer import (
    CompressionScheduler,
    compression_scheduler,
    init_compression,
    redundancy_clean,
)
from zquant.compression.config import (
    CompressionConfig,
    CompressionConfigError,
    load_compression_config,
)

__all__ = [
    "CompressionConfig",
    "CompressionConfigError",
    "CompressionScheduler",
    "compression_scheduler",
    "init_compression",
    "load_compression_config",
    "redundancy_clean",
]
