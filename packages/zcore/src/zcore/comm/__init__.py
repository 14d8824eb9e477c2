"""Process groups and the collectives the engine issues through them.

:class:`ProcessGroups` is built once per engine (data-parallel today; the
expert-parallel and hierarchical groups of later packages hang off the same
object). :class:`Comm` wraps every collective so that one which never
completes, or whose peer died, ends the job with a :class:`CollectiveError`
naming the rank, the collective and the training step.
"""

from zcore.comm.collectives import CollectiveError, Comm, Handle
from zcore.comm.groups import ProcessGroups, init_distributed

__all__ = ["CollectiveError", "Comm", "Handle", "ProcessGroups", "init_distributed"]
