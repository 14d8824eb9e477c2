"""Monitor blocks: ``tensorboard`` and ``csv_monitor`` (DeepSpeed's ``wandb`` and
``comet`` are gated features, see :mod:`zcore.config.features`)."""

from __future__ import annotations

from zcore.config._base import Bool, ZModel


class MonitorConfig(ZModel):
    """Keys shared by DeepSpeed's monitor blocks."""

    enabled: Bool = False
    """Write training metrics (loss, learning rate, loss scale) through this monitor."""
    output_path: str = ""
    """Directory the monitor writes under; empty means the current directory."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory (and run name) for this job."""


class TensorBoardConfig(MonitorConfig):
    """``tensorboard``: event files readable by TensorBoard."""


class CSVMonitorConfig(MonitorConfig):
    """``csv_monitor``: one CSV file per metric."""
