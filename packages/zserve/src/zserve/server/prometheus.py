"""Prometheus text exposition (format 0.0.4) without a client library.

Only what the server reports: labelled counters, gauges read when scraped,
and cumulative histograms of latencies. All updates happen on the event
loop thread, so no locking.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass
class Counter:
    """A monotonically increasing count, one series per label set."""

    name: str
    help: str
    values: dict[tuple[tuple[str, str], ...], float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, value in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(key)} {_num(value)}")
        return lines


@dataclass
class Gauge:
    """A value read when scraped; ``read`` returns {label set: value} or one number."""

    name: str
    help: str
    read: Callable[[], float | dict[tuple[tuple[str, str], ...], float]]

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        value = self.read()
        series = value if isinstance(value, dict) else {(): value}
        for key, v in sorted(series.items()):
            lines.append(f"{self.name}{_labels(key)} {_num(v)}")
        return lines


@dataclass
class Histogram:
    """Cumulative buckets, sum and count of observations (seconds)."""

    name: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for bound, c in zip(self.buckets, self.counts, strict=True):
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {c}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_num(self.total)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class Registry:
    """The metrics of one process, rendered in registration order."""

    def __init__(self) -> None:
        self._metrics: list[Counter | Gauge | Histogram] = []

    def counter(self, name: str, help: str) -> Counter:
        return self._add(Counter(name, help))

    def gauge(self, name: str, help: str, read: Callable[[], float | dict]) -> Gauge:
        return self._add(Gauge(name, help, read))

    def histogram(self, name: str, help: str) -> Histogram:
        return self._add(Histogram(name, help))

    def _add(self, metric):
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics:
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


def parse_prometheus(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` of a text exposition; for tests and the router."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out
