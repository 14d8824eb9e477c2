"""Type stub for the compiled module ``znative._native`` (checked by ``mypy.stubtest``)."""

from typing import Any

__all__ = [
    "DTypeError",
    "HyperparameterError",
    "LayoutError",
    "ShapeMismatchError",
    "SimdError",
    "__version__",
    "adagrad_step",
    "adam_step",
    "detected_simd_level",
    "lion_step",
    "num_threads",
    "set_simd_level",
    "simd_level",
    "stream_4r3w",
]

__version__: str

class ShapeMismatchError(ValueError): ...
class HyperparameterError(ValueError): ...
class LayoutError(ValueError): ...
class SimdError(ValueError): ...
class DTypeError(TypeError): ...

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
def stream_4r3w(a: _Array, b: _Array, c: _Array, d: _Array) -> None: ...
