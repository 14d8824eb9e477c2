"""Cutting a list of layers into contiguous pipeline stages.

DeepSpeed's ``partition_method`` values: ``"parameters"`` balances the trainable parameter
count, ``"uniform"`` the number of layers, ``"type:REGEX"`` the number of layers whose class
name matches ``REGEX`` (case-insensitive). Each stage gets at least one layer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


class PartitionError(ValueError):
    """The layers cannot be cut into the stages asked for."""


def balanced(weights: Sequence[int], parts: int) -> list[int]:
    """Boundaries ``[0, b1, ..., len(weights)]`` of ``parts`` contiguous non-empty runs
    minimizing the heaviest run's total weight (ties: the earliest cut)."""
    n = len(weights)
    if parts > n:
        raise PartitionError(f"{n} layers cannot fill {parts} stages")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest heaviest run cutting the first i layers into k runs
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def layer_weights(method: str, names: Sequence[str], params: Sequence[int]) -> list[int]:
    """Each layer's weight under ``method`` (``names``: class names, ``params``: counts)."""
    if method == "parameters":
        # a layer without parameters still costs something: never a stage of them alone
        return [max(p, 1) for p in params]
    if method == "uniform":
        return [1] * len(names)
    if method.startswith("type:"):
        pattern = re.compile(method.removeprefix("type:"), re.IGNORECASE)
        return [1 if pattern.search(n) else 0 for n in names]
    raise PartitionError(
        f"partition_method {method!r} is not one of 'parameters', 'uniform', 'type:REGEX'"
    )


def partition(method: str, names: Sequence[str], params: Sequence[int], parts: int) -> list[int]:
    """Stage boundaries for ``parts`` stages (see the module docstring), checked."""
    n = len(names)
    if n < parts:
        raise PartitionError(
            f"the pipeline has {n} layers but {parts} stages; every stage needs at least one "
            f"layer: give at least {parts} layers or use at most {n} stages"
        )
    weights = layer_weights(method, names, params)
    if method.startswith("type:"):
        matched = sum(weights)
        if matched < parts:
            raise PartitionError(
                f"partition_method {method!r} matches {matched} of the {n} layers "
                f"({', '.join(sorted(set(names)))}) but there are {parts} stages; use a "
                "pattern matching at least one layer per stage"
            )
    return balanced(weights, parts)
