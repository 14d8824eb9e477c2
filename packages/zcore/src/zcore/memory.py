"""How many bytes of model state ZeRO keeps on each accelerator, in host RAM and on NVMe.

Model state is the parameters, their gradients and the optimizer state; activations,
communication buckets, allocator fragmentation and the CUDA context are not counted.
For mixed-precision Adam (Ψ parameters, N ranks; bf16/fp16 params and grads, 12 bytes of
fp32 master weights, momentum and variance per parameter) the device bytes per rank are:

    stage 0   2Ψ   + 2Ψ   + 12Ψ        = 16Ψ
    stage 1   2Ψ   + 2Ψ   + 12Ψ/N      = 4Ψ + 12Ψ/N
    stage 2   2Ψ   + 2Ψ/N + 12Ψ/N      = 2Ψ + 14Ψ/N
    stage 3   2Ψ/N + 2Ψ/N + 12Ψ/N      = 16Ψ/N

Offload follows DeepSpeed's `estimate_zero2_model_states_mem_needs` and
`estimate_zero3_model_states_mem_needs`: offloading the optimizer moves its 12Ψ/N shard off
the device and keeps the fp32 gradient shard (4Ψ/N) the CPU optimizer steps on in host RAM;
at stages 2 and 3 that replaces the device gradient shard, at stage 1 the device still holds
full gradients. Offloading parameters (stage 3) moves the 2Ψ/N parameter shard. Host numbers per node are multiplied by `additional_buffer_factor`
(1.5, as DeepSpeed does) for pinned buffers and allocator slack.

A shard holds ceil(Ψ/N) elements: ZeRO pads flat partitions so every rank holds the same
number, so when N does not divide Ψ the numbers round up, never down.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import Any

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
STAGES = (0, 1, 2, 3)
_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


@dataclass(frozen=True)
class MemoryEstimate:
    """Model-state bytes for one ZeRO configuration (see the module docstring for formulas).

    Device fields are per rank (one accelerator); `host_*` and `nvme_*` fields say where
    offload puts state.
    """

    num_params: int
    """Ψ, the parameters of the whole model."""
    world_size: int
    """N, the data-parallel ranks the state is sharded over."""
    stage: int
    offload_optimizer: str
    offload_param: str
    gpus_per_node: int
    """Ranks per node; `host_per_node` and `nvme_per_node` count this many ranks."""

    params: int
    """Device bytes of low-precision parameters: 2Ψ, or the 2Ψ/N shard at stage 3 (0 when
    parameters are offloaded)."""
    grads: int
    """Device bytes of low-precision gradients: 2Ψ at stages 0-1, the 2Ψ/N shard at stages
    2-3 (0 there when the optimizer is offloaded: the shard lives on the host in fp32)."""
    optimizer: int
    """Device bytes of optimizer state (fp32 master weights, momentum, variance): 12Ψ at
    stage 0, the 12Ψ/N shard at stages 1-3 (0 when the optimizer is offloaded)."""
    gathered: int
    """Stage 3 working set: parameters and gradients of the largest layer, gathered in full
    while it runs (DeepSpeed's 4 * largest_layer_params); 0 at stages 0-2."""
    total: int
    """All device bytes per rank: params + grads + optimizer + gathered."""

    host_params: int
    """Host bytes per rank of the offloaded parameter shard (stage 3, `offload_param=cpu`)."""
    host_grads: int
    """Host bytes per rank of the fp32 gradient shard the CPU optimizer steps on."""
    host_optimizer: int
    """Host bytes per rank of optimizer state (`offload_optimizer=cpu`)."""
    host_per_rank: int
    """host_params + host_grads + host_optimizer, without the buffer factor."""
    host_per_node: int
    """host_per_rank * gpus_per_node * additional_buffer_factor, rounded up."""
    nvme_per_rank: int
    """Bytes per rank on NVMe: optimizer state and/or the parameter shard. The host swap
    buffers NVMe offload also needs are not counted."""
    nvme_per_node: int
    """nvme_per_rank * gpus_per_node."""

    def to_dict(self) -> dict[str, Any]:
        """Every field, for JSON output."""
        return dataclasses.asdict(self)


def _check_int(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_device(name: str, value: str) -> None:
    if value not in OFFLOAD_DEVICES:
        valid = ", ".join(repr(d) for d in OFFLOAD_DEVICES)
        raise ValueError(f"{name} {value!r} is not a valid device; use one of {valid}")


def _shard(count: int, world_size: int) -> int:
    """Elements one rank holds of `count` partitioned over `world_size` (padded, so ceil)."""
    return -(-count // world_size)


def model_state_bytes(
    params: int,
    world_size: int,
    stage: int,
    *,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    gpus_per_node: int | None = None,
    largest_layer_params: int = 0,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optim_bytes_per_param: int = 12,
    offload_grad_bytes: int = 4,
    additional_buffer_factor: float = 1.5,
) -> MemoryEstimate:
    """Model-state bytes per rank on the device, and on host/NVMe where offload puts them.

    `params` is Ψ and `world_size` N. `offload_optimizer` ("none", "cpu", "nvme") needs
    stage 1-3; `offload_param` needs stage 3. `gpus_per_node` (default: all N on one node)
    only scales the per-node host/NVMe numbers. `largest_layer_params` (stage 3 only) adds
    the gathered working set `(param_bytes + grad_bytes) * largest_layer_params` to the
    device total. `offload_grad_bytes` is the width of the gradient partition the offloaded
    optimizer steps on (fp32): in host memory with CPU offload, in a swap file with NVMe
    offload (zoffload swaps it with the master and state). `additional_buffer_factor`
    scales only `host_per_node`.

    Differences from DeepSpeed's estimators, which count more than model state: without
    offload its stage 2 number is 4Ψ + 16Ψ/N (full fp16 gradients before reduction plus an
    fp32 gradient shard) and its stage 3 number is 18Ψ/N (pass `grad_bytes=4` to get it);
    its host numbers without zero.Init also include loading the fp32 model on every process
    (4Ψ per rank), and its stage 2 host number is not divided by the node count.

    Raises:
        ValueError: an argument is out of range; the message names it, its value and what
            is valid.
    """
    _check_int("params", params)
    _check_int("world_size", world_size)
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be one of 0, 1, 2, 3, got {stage!r}")
    _check_device("offload_optimizer", offload_optimizer)
    _check_device("offload_param", offload_param)
    if offload_optimizer != "none" and stage == 0:
        raise ValueError(
            f"offload_optimizer={offload_optimizer!r} needs ZeRO stage 1, 2 or 3, got stage 0"
        )
    if offload_param != "none" and stage != 3:
        raise ValueError(f"offload_param={offload_param!r} needs ZeRO stage 3, got stage {stage}")
    if gpus_per_node is None:
        gpus_per_node = world_size
    _check_int("gpus_per_node", gpus_per_node)
    if world_size % gpus_per_node:
        raise ValueError(
            f"world_size {world_size} is not a multiple of gpus_per_node {gpus_per_node}"
        )
    _check_int("largest_layer_params", largest_layer_params, minimum=0)
    if largest_layer_params and stage != 3:
        raise ValueError(
            f"largest_layer_params={largest_layer_params} applies to ZeRO stage 3 only, "
            f"got stage {stage}"
        )
    if largest_layer_params > params:
        raise ValueError(f"largest_layer_params {largest_layer_params} exceeds params {params}")
    _check_int("param_bytes", param_bytes)
    _check_int("grad_bytes", grad_bytes)
    _check_int("optim_bytes_per_param", optim_bytes_per_param, minimum=0)
    _check_int("offload_grad_bytes", offload_grad_bytes, minimum=0)
    if not additional_buffer_factor >= 1.0:
        raise ValueError(
            f"additional_buffer_factor must be >= 1.0, got {additional_buffer_factor!r}"
        )

    shard = _shard(params, world_size)
    param_elems = shard if stage == 3 else params
    grad_elems = shard if stage >= 2 else params
    optim_elems = shard if stage >= 1 else params

    dev_params = param_elems * param_bytes
    dev_grads = grad_elems * grad_bytes
    dev_optim = optim_elems * optim_bytes_per_param
    host_params = host_grads = host_optim = nvme_per_rank = 0
    if offload_param == "cpu":
        host_params, dev_params = dev_params, 0
    elif offload_param == "nvme":
        nvme_per_rank, dev_params = dev_params, 0
    if offload_optimizer != "none":
        if offload_optimizer == "cpu":
            host_optim = dev_optim
        else:
            nvme_per_rank += dev_optim
        dev_optim = 0
        # The CPU optimizer steps on an fp32 gradient partition: in host memory, or with
        # NVMe in a swap file beside the master and state (zoffload's NvmeStore).
        # At stage 1 the device still holds full gradients.
        if offload_optimizer == "cpu":
            host_grads = shard * offload_grad_bytes
        else:
            nvme_per_rank += shard * offload_grad_bytes
        if stage >= 2:
            dev_grads = 0
    gathered = largest_layer_params * (param_bytes + grad_bytes)
    host_per_rank = host_params + host_grads + host_optim
    factor = Decimal(repr(float(additional_buffer_factor)))
    return MemoryEstimate(
        num_params=params,
        world_size=world_size,
        stage=stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        gpus_per_node=gpus_per_node,
        params=dev_params,
        grads=dev_grads,
        optimizer=dev_optim,
        gathered=gathered,
        total=dev_params + dev_grads + dev_optim + gathered,
        host_params=host_params,
        host_grads=host_grads,
        host_optimizer=host_optim,
        host_per_rank=host_per_rank,
        host_per_node=_ceil(host_per_rank * gpus_per_node * factor),
        nvme_per_rank=nvme_per_rank,
        nvme_per_node=nvme_per_rank * gpus_per_node,
    )


def _ceil(value: Decimal) -> int:
    return int(value.to_integral_value(rounding=ROUND_CEILING))


def formula_bytes(params: int, world_size: int, stage: int) -> int:
    """Device model-state bytes per rank for mixed-precision Adam without offload:
    16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N or 16Ψ/N for stages 0-3 (shards rounded up)."""
    return model_state_bytes(params, world_size, stage).total


def parse_count(text: str | int) -> int:
    """Parse a count such as "1.3B", "125M", "7b", "1.3e9" or "350_000" to an int.

    Suffixes K, M, B, T (any case) are powers of 1000. The result must be a whole,
    non-negative number: "1.3B" is 1_300_000_000, "1.5" is an error.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"count must be >= 0, got {text}")
        return text
    raw = str(text)
    s = raw.strip().replace("_", "").replace(",", "")
    multiplier = 1
    if s and s[-1].lower() in _SUFFIXES:
        multiplier = _SUFFIXES[s[-1].lower()]
        s = s[:-1].strip()
    try:
        value = Decimal(s) * multiplier
    except InvalidOperation:
        value = None
    hint = 'use a number with an optional K/M/B/T suffix, e.g. "125M", "1.3B" or "7e9"'
    if value is None or not value.is_finite():
        raise ValueError(f"{raw!r} is not a count; {hint}")
    if value < 0 or value != value.to_integral_value():
        raise ValueError(f"{raw!r} is not a whole, non-negative count; {hint}")
    return int(value)


def format_bytes(n: int) -> str:
    """Binary units with two decimals: 0 → "0 B", 1536 → "1.50 KiB", 2**31 → "2.00 GiB"."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.2f} {unit}"
