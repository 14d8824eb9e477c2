"""zcore: the zstack training engine.

zcore will own ``initialize()`` and the engine (forward/backward/step,
gradient accumulation, mixed precision, clipping), ZeRO stages 0-3, process
groups, DeepSpeed-compatible config, sharded checkpoints and the memory
estimator. Today it provides the native CPU optimizers in :mod:`zcore.optim`.
"""

__version__ = "0.1.0"
