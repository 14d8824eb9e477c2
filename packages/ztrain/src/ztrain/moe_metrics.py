"""What the MoE layers did in one optimizer step, summed over micro-batches and ranks.

Each rank adds every MoE layer's `last_stats` after each micro-batch's forward
(`MoETally.add`), hands `vector()` to the step's all-gather, and rank 0 turns the rows of
all ranks into the metrics record (`record`):

    aux_loss          mean load-balancing loss (zmoe's `l_aux`, unscaled) over MoE layers,
                      micro-batches and ranks
    dropped_fraction  routes the capacity limit dropped / routes asked for, all MoE layers
    expert_load       per MoE layer, each expert's share of that layer's kept routes
                      (summed over ranks; 1/E each when balanced)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class MoETally:
    """One rank's running sums for the MoE layers of a model (none: an empty vector)."""

    def __init__(self, layers: Sequence[Any]) -> None:
        self.layers = list(layers)
        self.sizes = [layer.num_experts for layer in self.layers]
        self.reset()

    def reset(self) -> None:
        self.aux, self.micro, self.routes = 0.0, 0, 0.0
        self.load = [[0.0] * n for n in self.sizes]

    def add(self) -> None:
        """Read every layer's `last_stats` (after a forward)."""
        if not self.layers:
            return
        self.micro += 1
        for i, layer in enumerate(self.layers):
            stats = layer.last_stats
            self.aux += float(stats.aux_loss)
            self.routes += float(stats.routes)
            for e, n in enumerate(stats.expert_load.tolist()):
                self.load[i][e] += n

    def vector(self) -> list[float]:
        """`[mean aux, routes, loads...]`: this rank's step, for the all-gather; then reset."""
        if not self.layers:
            return []
        aux = self.aux / (self.micro * len(self.layers)) if self.micro else 0.0
        out = [aux, self.routes, *(n for layer in self.load for n in layer)]
        self.reset()
        return out

    def record(self, rows: Sequence[Sequence[float]]) -> dict[str, Any]:
        """The metrics of the step from every rank's `vector()` (rank order)."""
        if not self.layers:
            return {}
        aux = sum(r[0] for r in rows) / len(rows)
        routes = sum(r[1] for r in rows)
        flat = [sum(col) for col in zip(*(r[2:] for r in rows), strict=True)]
        kept, load, at = sum(flat), [], 0
        for n in self.sizes:
            layer, at = flat[at : at + n], at + n
            total = sum(layer)
            load.append([round(x / total, 5) if total else 0.0 for x in layer])
        return {
            "aux_loss": aux,
            "dropped_fraction": 1.0 - kept / routes if routes else 0.0,
            "expert_load": load,
        }
