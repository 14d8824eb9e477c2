"""zoffload: ZeRO-Offload and ZeRO-Infinity.

This package will own moving model states off the accelerator: fp32 master
weights and optimizer state in (pinned) host memory with the step run by
``zcore.optim.CPUAdam`` (ZeRO-Offload), and parameter / optimizer-state
partitions swapped to NVMe files through the native async-IO engine
(ZeRO-Infinity), with a bounded pool of pinned buffers and prefetch driven by
ZeRO stage 3's recorded module trace.

Nothing is implemented yet; importing it gives only this docstring and the
version.
"""

__version__ = "0.1.0"
