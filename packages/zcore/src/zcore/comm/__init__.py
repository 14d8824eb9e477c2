"""Process groups and the collectives the engine issues through them.

:class:`Mesh` is the job's device mesh, built once per job on torch's ``DeviceMesh``
with named axes (``pp``, ``dp_replicate``, ``dp``, ``tp``; ``dp_local``, ``ep``/``edp``
views); nothing else creates process groups. :class:`Comm` wraps every collective so that one which never
completes, or whose peer died, ends the job with a :class:`CollectiveError`
naming the rank, the collective and the training step.
"""

from zcore.comm.collectives import CollectiveError, Comm, Handle
from zcore.comm.groups import init_distributed
from zcore.comm.mesh import Mesh, MeshError, MeshSpec, job_mesh, mesh_for_config

__all__ = [
    "CollectiveError",
    "Comm",
    "Handle",
    "Mesh",
    "MeshError",
    "MeshSpec",
    "init_distributed",
    "job_mesh",
    "mesh_for_config",
]
