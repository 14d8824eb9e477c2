"""Which checkpoint `z train --resume` continues from: `latest`, or the newest complete one.

A checkpoint is complete when a load finds every file it reads (`manifest.json`,
`common.pt` and each rank file the manifest counts: `zcore.checkpoint.missing_files`).
zcore publishes a checkpoint only once it is whole, so an incomplete one named by `latest`
means something removed files after the save, or a second writer on the directory;
`--resume` then continues from the newest complete checkpoint instead and says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ztrain.train_options import TrainError


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resumed run loads."""

    tag: str
    step: int
    """Its optimizer step (`global_steps` in its manifest)."""
    warning: str | None = None
    """Why this is not the checkpoint `latest` names; None when it is."""


def _step(path: Path) -> int:
    return int(json.loads((path / "manifest.json").read_text())["global_steps"])


def find_resume_point(ckpt_dir: Path) -> ResumePoint:
    """The checkpoint in `ckpt_dir` to resume: the one `latest` names when it is complete,
    else the complete one with the most steps. Raises TrainError when there is none."""
    from zcore.checkpoint import missing_files

    latest = ckpt_dir / "latest"
    if not latest.is_file():
        raise TrainError(
            f"no checkpoint to resume in `{ckpt_dir}` (no `latest` checkpoint); "
            f"run `z train --out {ckpt_dir.parent}` without `--resume` first"
        )
    tag = latest.read_text().strip()
    missing = missing_files(ckpt_dir / tag)
    if not missing:
        return ResumePoint(tag, _step(ckpt_dir / tag))
    complete = sorted(
        (_step(d), d.name)
        for d in ckpt_dir.iterdir()
        if d.is_dir() and not d.name.startswith(".") and d.name != tag and not missing_files(d)
    )
    what = f"checkpoint `{tag}` (named by `{latest}`) is incomplete: no {', '.join(missing)}"
    if not complete:
        raise TrainError(
            f"{what}, and `{ckpt_dir}` holds no complete checkpoint to resume instead; "
            f"run `z train --out {ckpt_dir.parent}` without `--resume` to start over"
        )
    step, best = complete[-1]
    return ResumePoint(best, step, f"{what}; resuming from `{best}` (step {step}) instead")
