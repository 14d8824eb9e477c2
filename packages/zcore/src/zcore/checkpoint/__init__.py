"""Sharded, atomic checkpoints that load at any (pp, tp, dp) layout.

Layout of ``save_dir``::

    latest                  the tag of the newest complete checkpoint
    <tag>/manifest.json     mesh, stage, dtype, parameter layout and table, counters, config
    <tag>/common.pt         rank 0: frozen parameters, buffers, scheduler, client state
    <tag>/rank_00000.pt     each writing rank: its fp32 master and optimizer-state slots
                            (the first rank of a later pipeline stage: its stage's frozen
                            parameters and buffers too)

A checkpoint saved with any number of pipeline stages, tensor-parallel size and
data-parallel size loads directly at any other: each rank reads the pieces of the
parameters it now holds and re-cuts them (:mod:`zcore.checkpoint.reshard`; the manifest's
parameter table, :mod:`zcore.checkpoint.table`). ``consolidate`` gives one tensor per
parameter name from any layout.

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
