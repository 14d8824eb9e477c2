"""Batch-size arithmetic: any two of (train, micro, accumulation) fix the third for a world
size, and every inconsistent combination fails with all its numbers spelled out."""

# The messages spell products with the multiplication sign; the tests compare them literally.
# ruff: noqa: RUF001

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zcore.config import BatchSizes, ConfigError, ZConfig, resolve_batch_sizes

sizes = st.integers(1, 64)
worlds = st.integers(1, 16)


def batch(world: int, **given_sizes: int) -> BatchSizes:
    return ZConfig.load(given_sizes).batch_sizes(world)


def batch_error(world: int, **given_sizes: int) -> str:
    with pytest.raises(ConfigError) as info:
        batch(world, **given_sizes)
    (problem,) = info.value.problems
    return problem.message


def check(sizes_: BatchSizes, world: int) -> None:
    assert sizes_.world_size == world
    assert sizes_.train_batch_size == (
        sizes_.micro_batch_size * sizes_.gradient_accumulation_steps * world
    )
    assert all(
        type(v) is int and v >= 1
        for v in (
            sizes_.train_batch_size,
            sizes_.micro_batch_size,
            sizes_.gradient_accumulation_steps,
        )
    )


@given(micro=sizes, gas=sizes, world=worlds, drop=st.sampled_from(["", "train", "micro", "gas"]))
def test_any_two_consistent_sizes_give_back_all_three(
    micro: int, gas: int, world: int, drop: str
) -> None:
    full = {
        "train_batch_size": micro * gas * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
    }
    key = {
        "train": "train_batch_size",
        "micro": "train_micro_batch_size_per_gpu",
        "gas": "gradient_accumulation_steps",
    }.get(drop)
    if key:
        del full[key]
    result = batch(world, **full)
    check(result, world)
    assert (result.micro_batch_size, result.gradient_accumulation_steps) == (micro, gas)


@given(train=st.integers(1, 512), world=worlds)
def test_only_train_means_no_accumulation(train: int, world: int) -> None:
    if train % world:
        message = batch_error(world, train_batch_size=train)
        assert f"train_batch_size {train} is not a multiple of world size {world}" in message
        assert f"= {train}/{world} is not a whole number" in message
    else:
        result = batch(world, train_batch_size=train)
        check(result, world)
        assert result.gradient_accumulation_steps == 1


@given(micro=sizes, world=worlds)
def test_only_micro_means_no_accumulation(micro: int, world: int) -> None:
    result = batch(world, train_micro_batch_size_per_gpu=micro)
    check(result, world)
    assert (result.train_batch_size, result.gradient_accumulation_steps) == (micro * world, 1)


@given(train=st.integers(1, 512), micro=sizes, gas=sizes, world=worlds)
def test_three_sizes_must_multiply_out(train: int, micro: int, gas: int, world: int) -> None:
    given_sizes = {
        "train_batch_size": train,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
    }
    product = micro * gas * world
    if train == product:
        check(batch(world, **given_sizes), world)
    else:
        assert batch_error(world, **given_sizes) == (
            f"train_batch_size {train} != train_micro_batch_size_per_gpu {micro} × "
            f"gradient_accumulation_steps {gas} × world size {world} = {product}; "
            f"set train_batch_size to {product} or drop one of the three"
        )


@given(train=st.integers(1, 512), other=sizes, world=worlds, with_micro=st.booleans())
def test_train_with_one_other_must_divide(
    train: int, other: int, world: int, with_micro: bool
) -> None:
    key = "train_micro_batch_size_per_gpu" if with_micro else "gradient_accumulation_steps"
    step = other * world
    if train % step == 0:
        check(batch(world, train_batch_size=train, **{key: other}), world)
        return
    message = batch_error(world, train_batch_size=train, **{key: other})
    assert message.startswith(
        f"train_batch_size {train} is not a multiple of {key} {other} × world size {world} = {step}"
    )
    assert f"set train_batch_size to a multiple of {step} (e.g. " in message
    suggested = message.rsplit("(e.g. ", 1)[1].rstrip(")").split(" or ")
    assert all(int(s) % step == 0 and int(s) > 0 for s in suggested)


def test_the_example_from_the_style_guide() -> None:
    message = batch_error(
        2, train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2
    )
    assert message.startswith(
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 2"
        " × world size 2 = 16; set train_batch_size to 16"
    )


def test_only_accumulation_is_not_enough() -> None:
    message = batch_error(4, gradient_accumulation_steps=8)
    assert message.startswith(
        "gradient_accumulation_steps 8 alone does not determine the batch size"
    )


def test_no_batch_size_at_all() -> None:
    assert batch_error(4).startswith("no batch size given; set train_micro_batch_size_per_gpu")


@pytest.mark.parametrize("world", [0, -1, True, 2.0])
def test_world_size_must_be_a_positive_int(world: object) -> None:
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        resolve_batch_sizes(8, None, None, world)  # type: ignore[arg-type]


def test_batch_sizes_is_frozen() -> None:
    result = resolve_batch_sizes(None, 2, 3, 4)
    assert result == BatchSizes(24, 2, 3, 4)
    with pytest.raises(AttributeError):
        result.train_batch_size = 1  # type: ignore[misc]
