"""A tensor-parallel plan: how to cut one family of models over the ``tp`` ranks.

A :class:`Plan` knows one family of models: whether a model is one of them (from its
config, never from a checkpoint's name), every size that must divide by ``tp`` (all are
checked before anything changes, so one error names each number and the fix), and how to
swap its layers for tensor-parallel ones. :func:`swap_forward` and :func:`divides` are the
helpers plans share; :mod:`zcore.tensor.parallelize` chooses and runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from zcore.comm import Comm


@dataclass(frozen=True)
class Plan:
    """How to cut one family of models."""

    name: str
    matches: Callable[[nn.Module], bool]
    """Whether the model is of this family (read from its config)."""
    problems: Callable[[nn.Module, int], list[str]]
    """Every reason the model cannot be cut over ``tp`` ranks (empty: it can)."""
    apply: Callable[[nn.Module, Comm, bool], None]
    """Swap the model's layers for tensor-parallel ones cut over ``comm``, in place; the
    flag asks for sequence parallelism (a plan without it raises ``ValueError``)."""


_SWAPPED: dict[tuple[type, Callable[..., object]], type] = {}


def swap_forward(module: nn.Module, forward: Callable[..., object]) -> None:
    """Give ``module`` ``forward`` through a subclass of its class (its state is untouched,
    ``isinstance`` still holds)."""
    cls = type(module)
    key = (cls, forward)
    sub = _SWAPPED.get(key)
    if sub is None:
        sub = _SWAPPED[key] = type(f"TensorParallel{cls.__name__}", (cls,), {"forward": forward})
    module.__class__ = sub


def divides(problems: list[str], what: str, size: int, tp: int, fix: str) -> None:
    """Add a problem naming ``what`` ``size`` when ``tp`` does not divide it."""
    if size % tp:
        problems.append(
            f"{what} {size} is not divisible by tp {tp} ({size} % {tp} = {size % tp}); {fix}"
        )
