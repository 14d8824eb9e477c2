"""Sharded, atomic checkpoints that load on any data-parallel world size.

Layout of ``save_dir``::

    latest                  the tag of the newest complete checkpoint
    <tag>/manifest.json     world size, stage, dtype, parameter layout, counters, config
    <tag>/common.pt         rank 0: frozen parameters, buffers, scheduler, client state
    <tag>/rank_00000.pt     each rank: its fp32 master slots and optimizer-state slots

A checkpoint is written into ``.tmp-<tag>/`` and renamed into place only when every rank
has written and fsynced its file; ``latest`` is updated last. A crash or a full disk at any
point leaves the previous checkpoint, and ``latest``, as they were. A load reads and checks
every file before it changes anything: a damaged checkpoint, or one that does not fit the
engine, raises :class:`CheckpointError` and leaves training as it was.
"""

from zcore.checkpoint.complete import missing_files
from zcore.checkpoint.consolidate import consolidate
from zcore.checkpoint.files import CheckpointError, atomic_path, atomic_write
from zcore.checkpoint.restore import load
from zcore.checkpoint.sharded import save

__all__ = [
    "CheckpointError",
    "atomic_path",
    "atomic_write",
    "consolidate",
    "load",
    "missing_files",
    "save",
]
