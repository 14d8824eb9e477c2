"""zcomm: compressed collectives, DeepSpeed's 1-bit optimizers and ZeRO++, on any backend.

Everything runs over ``zcore.comm.Comm`` (gloo and NCCL alike), is tested against a
readable single-process reference, and counts its bytes through zcore's accounting:

- :mod:`zcomm.signs` / :mod:`zcomm.blockquant`: 1-bit signs with their scale, blockwise
  INT8/INT4 codes (torch references); :mod:`zcomm.kernels` dispatches to znative's Rust
  kernels on CPU and the ``.cu`` twins on CUDA, bit-identical to the references;
- :class:`zcomm.compressed.CompressedAllReduce`: DeepSpeed's two-phase 1-bit all-reduce
  with worker and server error feedback; :mod:`zcomm.compressed_scatter`: its first phase
  alone, the compressed reduce-scatter ZeRO stages 1-2 need;
- :mod:`zcomm.optim`: ``OneBitAdam`` (ZeRO 0-2), ``ZeroOneAdam`` and ``OneBitLamb`` (ZeRO
  0), registered as optimizer types through the ``zcore.optimizers`` entry points, error
  feedback checkpointed per rank;
- :mod:`zcomm.zeropp`: ZeRO++ (qwZ, hpZ, qgZ with LoCo) as zcore collectives, switched on
  by DeepSpeed's ``zero_optimization`` keys (the ``zcore.extensions`` entry point).
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
