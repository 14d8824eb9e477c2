"""Batch-size arithmetic: ``train_batch_size = micro * accumulation steps * world size``.

DeepSpeed lets a config give any of the three; the ones left out follow from
the others and the world size, which is only known at launch. Every message
spells the arithmetic with its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from zcore.config.errors import ConfigError, ConfigProblem

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
#: The multiplication sign that messages spell products with.
TIMES = "\N{MULTIPLICATION SIGN}"


@dataclass(frozen=True)
class BatchSizes:
    """The resolved batch sizes of one run; ``train == micro * accumulation * world``."""

    train_batch_size: int
    """Samples per optimizer step, over all ranks."""
    micro_batch_size: int
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int
    """Micro-batches whose gradients are summed before each optimizer step."""
    world_size: int
    """Data-parallel ranks the sizes were resolved for."""


def _examples(total: int, step: int) -> str:
    """Nearby multiples of ``step`` to suggest instead of ``total``."""
    below = (total // step) * step
    return f"{below} or {below + step}" if below > 0 else f"{step} or {2 * step}"


def _indivisible(
    train: int, divisor: int, terms: str, derived: str, extra: str = ""
) -> ConfigError:
    if TIMES in terms:
        terms = f"{terms} = {divisor}"
    return ConfigError(
        [
            ConfigProblem(
                TRAIN,
                f"{TRAIN} {train} is not a multiple of {terms}, so {derived} = "
                f"{train}/{divisor} is not a whole number{extra}; set {TRAIN} to a multiple of "
                f"{divisor} (e.g. {_examples(train, divisor)})",
                train,
            )
        ]
    )


def resolve_batch_sizes(
    train: int | None, micro: int | None, gas: int | None, world_size: int
) -> BatchSizes:
    """Fill in the batch sizes left out, as DeepSpeed does; ConfigError when they disagree.

    - all three: they must satisfy ``train == micro * gas * world``;
    - two: the third follows (and must be a whole number);
    - only ``train``: ``gas = 1``, ``micro = train / world``;
    - only ``micro``: ``gas = 1``, ``train = micro * world``;
    - only ``gas``, or none: an error, the batch size is not determined.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    w = world_size
    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * w:
            product = micro * gas * w
            raise ConfigError(
                [
                    ConfigProblem(
                        TRAIN,
                        f"{TRAIN} {train} != {MICRO} {micro} {TIMES} {GAS} {gas} {TIMES} world size {w} = "
                        f"{product}; set {TRAIN} to {product} or drop one of the three",
                        train,
                    )
                ]
            )
        return BatchSizes(train, micro, gas, w)
    if train is not None and micro is not None:
        if train % (micro * w):
            raise _indivisible(train, micro * w, f"{MICRO} {micro} {TIMES} world size {w}", GAS)
        return BatchSizes(train, micro, train // (micro * w), w)
    if train is not None and gas is not None:
        if train % (gas * w):
            raise _indivisible(train, gas * w, f"{GAS} {gas} {TIMES} world size {w}", MICRO)
        return BatchSizes(train, train // (gas * w), gas, w)
    if micro is not None and gas is not None:
        return BatchSizes(micro * gas * w, micro, gas, w)
    if train is not None:
        if train % w:
            raise _indivisible(
                train,
                w,
                f"world size {w}",
                MICRO,
                f" ({GAS} defaults to 1)",
            )
        return BatchSizes(train, train // w, 1, w)
    if micro is not None:
        return BatchSizes(micro * w, micro, 1, w)
    if gas is not None:
        raise ConfigError(
            [
                ConfigProblem(
                    GAS,
                    f"{GAS} {gas} alone does not determine the batch size; also set {MICRO} "
                    f"(samples per GPU) or {TRAIN} (samples per step over all GPUs)",
                    gas,
                )
            ]
        )
    raise ConfigError(
        [
            ConfigProblem(
                TRAIN,
                f"no batch size given; set {MICRO} (samples per GPU) or {TRAIN} "
                "(samples per step over all GPUs)",
            )
        ]
    )
