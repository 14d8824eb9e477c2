"""Whether a checkpoint directory holds every file a load of it reads."""

from __future__ import annotations

import os
from pathlib import Path

from zcore.checkpoint.files import CheckpointError, load_json
from zcore.checkpoint.rank_files import listed_files


def missing_files(path: str | os.PathLike[str]) -> list[str]:
    """The files that checkpoint ``path`` (one tag: ``save_dir/<tag>``) lacks for a load.

    Empty when it is complete: ``manifest.json`` is readable, and ``common.pt`` and the
    rank files the manifest lists (``files``; older ones: ``shard_world`` of them) are there, which are the files
    :func:`zcore.checkpoint.load` reads. A missing, unreadable or mangled manifest gives
    ``["manifest.json"]`` (it is what says which rank files there should be). Only
    presence is checked: the load itself finds a truncated file.
    """
    root = Path(path)
    try:
        needed = [*listed_files(load_json(root / "manifest.json")), "common.pt"]
    except (CheckpointError, KeyError, TypeError, ValueError):
        return ["manifest.json"]
    return [name for name in needed if not (root / name).is_file()]
