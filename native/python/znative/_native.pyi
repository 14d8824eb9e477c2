"""Type stub for the compiled module ``znative._native`` (checked by ``mypy.stubtest``)."""

import os
from typing import Any, final

__all__ = [
    "AioError",
    "AioFileNotFoundError",
    "AioHandle",
    "AioPermissionError",
    "AioShortReadError",
    "AlignedAllocation",
    "DTypeError",
    "HyperparameterError",
    "LayoutError",
    "ShapeMismatchError",
    "SimdError",
    "__version__",
    "adagrad_step",
    "adam_step",
    "add_rms_norm",
    "aligned_buffer",
    "column_absmax",
    "dequant_linear",
    "dequantize_blocks",
    "dequantize_weight",
    "detected_simd_level",
    "int8_gemm",
    "int8_linear",
    "int8_linear_split",
    "int8_vnni_available",
    "io_backend_probe",
    "linear_rows",
    "lion_step",
    "num_threads",
    "pack_signs",
    "paged_decode_attention",
    "quantize_blocks",
    "quantize_tokenwise",
    "rms_norm",
    "rotary_kv_write",
    "set_simd_level",
    "simd_level",
    "stream_4r3w",
    "team_stats",
    "unpack_signs",
]

__version__: str

class ShapeMismatchError(ValueError): ...
class HyperparameterError(ValueError): ...
class LayoutError(ValueError): ...
class SimdError(ValueError): ...
class DTypeError(TypeError): ...

class AioError(OSError):
    path: str | None
    offset: int | None

class AioFileNotFoundError(AioError, FileNotFoundError): ...
class AioPermissionError(AioError, PermissionError): ...
class AioShortReadError(AioError): ...

# Buffers are numpy arrays that view the caller's memory: params float32;
# grads and states float32, or bfloat16 viewed as int16/uint16. All C-contiguous.
_Array = Any

def simd_level() -> str: ...
def detected_simd_level() -> str: ...
def set_simd_level(level: str | None = None) -> None: ...
def num_threads() -> int: ...
def adam_step(
    params: _Array,
    grads: _Array,
    exp_avg: _Array,
    exp_avg_sq: _Array,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw: bool = False,
    bias_correction: bool = True,
    maximize: bool = False,
) -> None: ...
def adagrad_step(
    params: _Array,
    grads: _Array,
    state_sum: _Array,
    *,
    lr: float,
    lr_decay: float,
    eps: float,
    weight_decay: float,
    step: int,
    maximize: bool = False,
) -> None: ...
def lion_step(
    params: _Array,
    grads: _Array,
    exp_avg: _Array,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    step: int,
    maximize: bool = False,
) -> None: ...

# c and d: float32 (28 bytes per element) or both bfloat16 bits as int16 (20 bytes);
# pace: 0-3 dependent sqrt/divide pairs per vector (the fastest pace is the ceiling).
def stream_4r3w(a: _Array, b: _Array, c: _Array, d: _Array, *, pace: int = 0) -> None: ...

# Quantization kernels (zquant). int8/uint8/int32/float32 arrays, C-contiguous; weights (n, k).
def int8_gemm(a: _Array, b: _Array, out: _Array) -> None: ...
def quantize_tokenwise(x: _Array, q: _Array, scale: _Array, *, bits: int = 8) -> None: ...
def int8_linear(
    x: _Array, w: _Array, w_scale: _Array, bias: _Array | None, out: _Array, *, outliers: int = 0
) -> None: ...
def column_absmax(x: _Array, out: _Array) -> None: ...
def int8_linear_split(
    x: _Array,
    w: _Array,
    w_scale: _Array,
    bias: _Array | None,
    cols: _Array,
    out: _Array,
    xo: _Array,
    wc: _Array,
) -> None: ...
def dequantize_weight(
    data: _Array,
    scale: _Array,
    out: _Array,
    *,
    fmt: str,
    group_size: int,
    data2: _Array | None = None,
    zero: _Array | None = None,
    offset: int = 8,
) -> None: ...
def dequant_linear(
    x: _Array,
    data: _Array,
    scale: _Array,
    bias: _Array | None,
    out: _Array,
    *,
    fmt: str,
    group_size: int,
    data2: _Array | None = None,
    zero: _Array | None = None,
    offset: int = 8,
    act_bits: int | None = None,
) -> None: ...
def int8_vnni_available() -> bool: ...

# Compressed-collective kernels (zcomm). Arrays read flat, C-contiguous; layouts of
# zcomm.signs (MSB-first sign bits) and zcomm.blockquant (offset codes, INT4 low nibble first).
def pack_signs(x: _Array, out: _Array) -> float: ...
def unpack_signs(packed: _Array, scale: float, out: _Array) -> None: ...
def rms_norm(x: _Array, weight: _Array, out: _Array, *, eps: float) -> None: ...
def add_rms_norm(x: _Array, delta: _Array, weight: _Array, out: _Array, *, eps: float) -> None: ...
def team_stats() -> dict[str, int]: ...
def linear_rows(x: _Array, weight: _Array, out: _Array) -> None: ...
def rotary_kv_write(
    qkv: _Array,
    cos: _Array,
    sin: _Array,
    positions: _Array,
    slots: _Array,
    k_cache: _Array,
    v_cache: _Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None: ...
def paged_decode_attention(
    q: _Array,
    k_cache: _Array,
    v_cache: _Array,
    block_tables: _Array,
    context_lens: _Array,
    out: _Array,
    *,
    scale: float,
) -> None: ...
def quantize_blocks(x: _Array, codes: _Array, scales: _Array, *, bits: int, block: int) -> None: ...
def dequantize_blocks(
    codes: _Array, scales: _Array, out: _Array, *, bits: int, block: int
) -> None: ...

# Async file IO (zaio). Buffers: numpy arrays of any non-object dtype, C-contiguous.
@final
class AlignedAllocation:
    @property
    def nbytes(self) -> int: ...
    @property
    def locked(self) -> bool: ...
    @property
    def address(self) -> int: ...

def aligned_buffer(nbytes: int) -> _Array: ...
def io_backend_probe() -> tuple[str, str]: ...

@final
class AioHandle:
    def __new__(
        cls,
        block_size: int = 1048576,
        queue_depth: int = 8,
        intra_op_parallelism: int = 1,
        single_submit: bool = False,
        overlap_events: bool = True,
        backend: str = "auto",
    ) -> AioHandle: ...
    def pread(self, buffer: _Array, path: str | os.PathLike[str], offset: int = 0) -> int: ...
    def pwrite(self, buffer: _Array, path: str | os.PathLike[str], offset: int = 0) -> int: ...
    def wait(self, id: int | None = None) -> int: ...
    def sync_pread(self, buffer: _Array, path: str | os.PathLike[str], offset: int = 0) -> int: ...
    def sync_pwrite(self, buffer: _Array, path: str | os.PathLike[str], offset: int = 0) -> int: ...
    def pending(self) -> int: ...
    def stats(self) -> dict[str, int | str | None]: ...
    @property
    def backend(self) -> str: ...
    @property
    def backend_reason(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def intra_op_parallelism(self) -> int: ...
    @property
    def single_submit(self) -> bool: ...
    @property
    def overlap_events(self) -> bool: ...
