"""Training monitors: DeepSpeed's ``csv_monitor`` and ``tensorboard`` config blocks.

An event is ``(tag, value, step)``, e.g. ``("Train/Samples/lr", 1e-4, 128)``.
``MonitorMaster`` builds the enabled monitors from the two config blocks on rank 0 and
fans events out to them; on other ranks it does nothing.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol, runtime_checkable

__all__ = [
    "CSVMonitor",
    "Event",
    "Monitor",
    "MonitorMaster",
    "TensorBoardMonitor",
]

Event = tuple[str, float, int]
"""``(tag, value, step)``."""

DEFAULT_JOB_NAME = "DeepSpeedJobName"
DEFAULT_CSV_PATH = "./csv_monitor"
DEFAULT_TENSORBOARD_PATH = "./runs"
_CONFIG_KEYS = {"enabled", "output_path", "job_name"}


@runtime_checkable
class Monitor(Protocol):
    """Something that records scalar events."""

    def write_events(self, events: list[Event]) -> None:
        """Record each ``(tag, value, step)``; what was written survives a later crash."""
        ...

    def close(self) -> None:
        """Flush and release files; safe to call twice."""
        ...


def _make_log_dir(output_path: str | os.PathLike[str], job_name: str, kind: str) -> Path:
    """``<output_path>/<job_name>``, created; an OSError naming the path if it cannot be."""
    log_dir = Path(output_path) / job_name
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        # OSError(errno, ...) becomes the matching subclass (FileExistsError, ...).
        raise OSError(
            e.errno,
            f"{kind} monitor cannot create its log directory `{log_dir}` ({e.strerror}); "
            "set `output_path` to a writable directory",
            str(log_dir),
        ) from e
    return log_dir


class CSVMonitor:
    """One CSV file per tag under ``<output_path>/<job_name>/``, as DeepSpeed writes them.

    The file is the tag with ``/`` and spaces replaced by ``_`` plus ``.csv``; its header
    is ``step,<tag>`` and each event appends ``<step>,<value>``. Files are appended to,
    so a restarted job continues them (the header is written only to an empty file),
    and flushed after every ``write_events``.
    """

    def __init__(self, output_path: str | os.PathLike[str], job_name: str) -> None:
        self.log_dir = _make_log_dir(output_path, job_name, "csv")
        self._files: dict[str, tuple[IO[str], Any]] = {}
        self._closed = False

    def path_for(self, tag: str) -> Path:
        """The CSV file that holds ``tag``."""
        return self.log_dir / (tag.replace("/", "_").replace(" ", "_") + ".csv")

    def _writer(self, tag: str) -> tuple[IO[str], Any]:
        if tag not in self._files:
            path = self.path_for(tag)
            try:
                f = path.open("a", newline="")
            except OSError as e:
                raise OSError(
                    e.errno, f"csv monitor cannot open `{path}` ({e.strerror})", str(path)
                ) from e
            writer = csv.writer(f)
            if f.tell() == 0:
                writer.writerow(["step", tag])
            self._files[tag] = (f, writer)
        return self._files[tag]

    def write_events(self, events: list[Event]) -> None:
        """Append each event to its tag's file, then flush every file touched."""
        if self._closed:
            raise RuntimeError(f"csv monitor for `{self.log_dir}` is closed")
        touched = []
        for tag, value, step in events:
            f, writer = self._writer(tag)
            writer.writerow([int(step), float(value)])
            touched.append(f)
        for f in touched:
            f.flush()

    def close(self) -> None:
        """Close every open file."""
        self._closed = True
        files, self._files = self._files, {}
        for f, _ in files.values():
            f.close()


class TensorBoardMonitor:
    """Scalars into TensorBoard event files under ``<output_path>/<job_name>``.

    Writes through ``torch.utils.tensorboard.SummaryWriter`` and flushes after every
    ``write_events``. Needs the ``tensorboard`` package (``zcore[tensorboard]``).
    """

    def __init__(self, output_path: str | os.PathLike[str], job_name: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                f"the tensorboard monitor needs the `tensorboard` package ({e}); "
                'run `pip install "zcore[tensorboard]"`'
            ) from e
        self.log_dir = _make_log_dir(output_path, job_name, "tensorboard")
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir))

    def write_events(self, events: list[Event]) -> None:
        """Add each event as a scalar, then flush."""
        if self._writer is None:
            raise RuntimeError(f"tensorboard monitor for `{self.log_dir}` is closed")
        for tag, value, step in events:
            self._writer.add_scalar(tag, float(value), int(step))
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _block(config: Mapping[str, Any] | None, name: str) -> tuple[bool, str, str]:
    """``(enabled, output_path, job_name)`` from a ``{"enabled", "output_path", "job_name"}`` block."""
    if config is None:
        return False, "", DEFAULT_JOB_NAME
    unknown = sorted(set(config) - _CONFIG_KEYS)
    if unknown:
        raise ValueError(
            f"`{name}` config has unknown keys {unknown}; allowed: {sorted(_CONFIG_KEYS)}"
        )
    enabled = config.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"`{name}.enabled` must be true or false, got {enabled!r}")
    output_path = config.get("output_path") or ""
    job_name = config.get("job_name") or DEFAULT_JOB_NAME
    return enabled, str(output_path), str(job_name)


class MonitorMaster:
    """The monitors a config enables, on rank 0 only; every other rank gets a no-op.

    ``csv`` and ``tensorboard`` are the DeepSpeed ``csv_monitor`` / ``tensorboard``
    blocks as dicts: ``{"enabled": bool, "output_path": str, "job_name": str}``. An empty
    ``output_path`` means ``./csv_monitor`` (csv) or ``./runs`` (tensorboard). Usable as
    a context manager, which closes the monitors on exit.
    """

    def __init__(
        self,
        csv: Mapping[str, Any] | None = None,
        tensorboard: Mapping[str, Any] | None = None,
        rank: int = 0,
    ) -> None:
        # Validate on every rank so a bad config fails everywhere, not only on rank 0.
        csv_on, csv_path, csv_job = _block(csv, "csv_monitor")
        tb_on, tb_path, tb_job = _block(tensorboard, "tensorboard")
        self.rank = rank
        self.monitors: list[Monitor] = []
        if rank != 0:
            return
        try:
            if csv_on:
                self.monitors.append(CSVMonitor(csv_path or DEFAULT_CSV_PATH, csv_job))
            if tb_on:
                self.monitors.append(
                    TensorBoardMonitor(tb_path or DEFAULT_TENSORBOARD_PATH, tb_job)
                )
        except BaseException:
            self.close()
            raise

    @property
    def enabled(self) -> bool:
        """Whether any monitor writes on this rank."""
        return bool(self.monitors)

    def write_events(self, events: list[Event]) -> None:
        """Pass the events to every monitor (nothing happens off rank 0)."""
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        """Close every monitor."""
        monitors, self.monitors = self.monitors, []
        for monitor in monitors:
            monitor.close()

    def __enter__(self) -> MonitorMaster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
