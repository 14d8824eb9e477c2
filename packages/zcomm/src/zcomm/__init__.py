"""zcomm: compressed collectives.

Built so far (pure torch, over ``zcore.comm.Comm``, so it runs on gloo and NCCL alike):

- :mod:`zcomm.signs`: 1-bit compression, a tensor's signs packed 8 to a byte and the
  ``||x|| / sqrt(n)`` scale that goes with them;
- :class:`zcomm.compressed.CompressedAllReduce`: DeepSpeed's two-phase 1-bit all-reduce
  (all_to_all then all_gather) with worker and server error feedback, byte counts and
  ``state_dict`` for its error buffers; :func:`zcomm.reference.reference_compressed_allreduce`
  is the single-process model it is tested against.

- :mod:`zcomm.zeropp`: ZeRO++ (qwZ, hpZ, qgZ with LoCo) as zcore collectives, switched on
  by DeepSpeed's ``zero_optimization`` keys (registered through the ``zcore.extensions``
  entry point).

Not built yet: the optimizers that use it (1-bit Adam, 0/1 Adam, 1-bit LAMB), its hook into
zcore's collectives seam and checkpoints, native/CUDA packing kernels.
"""

from zcomm.compressed import CompressedAllReduce, ErrorFeedbackReset, WireBytes, wire_bytes
from zcomm.reference import reference_compressed_allreduce
from zcomm.zeropp import ZeroPP, ZeroPPConfig

__all__ = [
    "CompressedAllReduce",
    "ErrorFeedbackReset",
    "WireBytes",
    "ZeroPP",
    "ZeroPPConfig",
    "reference_compressed_allreduce",
    "wire_bytes",
]
__version__ = "0.1.0"
