"""The weight budget: which decoder layers stay resident and how many stream through slots.

The budget counts the bytes of decoder-layer weights held in memory: the resident layers
plus the slots the streamed ones pass through (one computing, ``prefetch`` arriving). The
embedding table, the final norm and the LM head stay resident outside it (the head is read
every step; its size is reported beside the budget). Resident layers are spread evenly over
the depth so that each streamed layer's fetch overlaps the compute of the layers before it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

OffloadKind = Literal["cpu", "nvme"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class WeightsBudgetError(ValueError):
    """A weight budget that cannot serve the model (smaller than one layer)."""


def parse_size(text: str | int) -> int:
    """Bytes from ``123``, ``64M``, ``1.5G``, ``200MiB`` or ``200MB`` (binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if m is None:
        raise ValueError(
            f"size {text!r} is not a size; write bytes or a number with K, M, G or T "
            "(binary units), e.g. `128M` or `1.5G`"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True)
class OffloadSpec:
    """Serve with at most ``budget`` bytes of decoder-layer weights in memory."""

    budget: int
    """Bytes of decoder-layer weights held: resident layers plus the streaming slots."""
    kind: OffloadKind = "cpu"
    """Where the streamed layers live: host memory, or a swap file under ``directory``."""
    directory: str | None = None
    """The swap file's directory (``nvme``)."""
    prefetch: int = 1
    """Streamed layers fetched ahead of the one computing."""

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise WeightsBudgetError(f"weights budget {self.budget} must be >= 1 byte")
        if self.kind == "nvme" and not self.directory:
            raise ValueError("offload 'nvme' needs a directory: `--offload-dir DIR`")
        if self.kind == "cpu" and self.directory:
            raise ValueError(
                f"offload directory {self.directory!r} is for offload 'nvme'; drop it or "
                "pass `--offload nvme`"
            )
        if not 1 <= self.prefetch <= 8:
            raise ValueError(f"prefetch {self.prefetch} must be in [1, 8]")


@dataclass
class Plan:
    """The layers kept resident, the layers streamed (in forward order) and their slots."""

    resident: list[int]
    streamed: list[int]
    slots: int
    slot_bytes: int
    layer_bytes: list[int] = field(repr=False)

    @property
    def held_bytes(self) -> int:
        """Decoder-layer bytes in memory: resident layers plus slots."""
        return sum(self.layer_bytes[i] for i in self.resident) + self.slots * self.slot_bytes

    @property
    def streamed_bytes(self) -> int:
        """Bytes fetched per forward."""
        return sum(self.layer_bytes[i] for i in self.streamed)

    def summary(self) -> dict[str, int]:
        return {
            "layers": len(self.layer_bytes),
            "resident_layers": len(self.resident),
            "streamed_layers": len(self.streamed),
            "slots": self.slots,
            "held_bytes": self.held_bytes,
            "streamed_bytes_per_forward": self.streamed_bytes,
            "layer_weights_bytes": sum(self.layer_bytes),
        }


def check_budget(budget: int, layer: int) -> None:
    """A :class:`WeightsBudgetError` if ``budget`` cannot hold a layer of ``layer`` bytes."""
    if budget < layer:
        raise WeightsBudgetError(
            f"weights budget {budget} bytes ({budget / 2**20:.1f} MiB) is smaller than one "
            f"decoder layer ({layer} bytes, {layer / 2**20:.1f} MiB); raise "
            f"`--weights-budget` to at least {2 * layer} (two layers: one computing, one "
            "arriving)"
        )


def plan_layers(layer_bytes: list[int], spec: OffloadSpec) -> Plan:
    """Fit ``layer_bytes`` (each layer's blob) into ``spec.budget``: as many resident layers
    as fit beside ``prefetch + 1`` slots (fewer slots, down to one, when only those fit);
    every layer resident when the whole stack fits."""
    n, budget = len(layer_bytes), spec.budget
    if sum(layer_bytes) <= budget:
        return Plan(list(range(n)), [], 0, 0, layer_bytes)
    largest = max(layer_bytes)
    check_budget(budget, largest)
    slots = min(spec.prefetch + 1, budget // largest)
    room = budget - slots * largest
    for count in range(n - slots, -1, -1):  # most resident layers that fit
        resident = (
            sorted({round((k + 0.5) * n / count - 0.5) for k in range(count)}) if count else []
        )
        if sum(layer_bytes[i] for i in resident) <= room:
            break
    streamed = [i for i in range(n) if i not in set(resident)]
    return Plan(resident, streamed, min(slots, len(streamed)), largest, layer_bytes)
