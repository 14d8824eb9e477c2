"""Cutting a list of layers into contiguous pipeline stages.

DeepSpeed's ``partition_method`` values: ``"parameters"`` balances the trainable parameter
count, ``"uniform"`` the number of layers, ``"type:REGEX"`` the number of layers whose class
name matches ``REGEX`` (case-insensitive). Each stage gets at least one layer.
"""

from __future__ import annotations

import itertools
import math
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


def balanced_v(weights: Sequence[int], parts: int, limit: int = 200_000) -> list[int] | None:
    """Boundaries for a V layout (rank ``r`` holds stages ``r`` and ``parts-1-r``) that
    minimize the heaviest *rank*, then the heaviest stage; None when there are more than
    ``limit`` ways to cut (then :func:`balanced` is used)."""
    n = len(weights)
    if math.comb(n - 1, parts - 1) > limit:
        return None
    prefix = list(itertools.accumulate(weights, initial=0))
    best, best_key = None, None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        stage = [prefix[b] - prefix[a] for a, b in itertools.pairwise(bounds)]
        ranks = [stage[r] + stage[parts - 1 - r] for r in range(parts // 2)]
        key = (max(ranks), max(stage))
        if best_key is None or key < best_key:
            best, best_key = bounds, key
    return best


def partition(
    method: str, names: Sequence[str], params: Sequence[int], parts: int, v_shape: bool = False
) -> list[int]:
    """Stage boundaries for ``parts`` stages (see the module docstring), checked; with
    ``v_shape`` balanced per rank of a V layout."""
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
    if v_shape:
        return balanced_v(weights, parts) or balanced(weights, parts)
    return balanced(weights, parts)
