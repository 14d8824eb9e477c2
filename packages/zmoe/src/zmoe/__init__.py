"""zmoe: Mixture-of-Experts layers, gating and expert parallelism.

``zmoe.MoE`` is DeepSpeed's ``deepspeed.moe.layer.MoE`` (same signature and outputs) with a
dropless path, sigmoid and aux-loss-free routing, router z-loss, and expert parallelism over
the job mesh's ``ep`` axis (``mesh_axes`` / ``bind_mesh``).

Files: ``gating.py`` (routers, losses), ``capacity.py`` (capacity-buffer dispatch),
``dropless.py`` (sorted dispatch), ``experts.py`` (experts named by global index),
``parallel.py`` (the autograd all-to-all), ``layer.py`` (the layer), ``distill.py``
(Mixture-of-Students: a shallower student cut from a teacher, staged KD).
"""

from zmoe.gating import Routing, TopKRouter
from zmoe.layer import MoE, MoEStats

__version__ = "0.1.0"

__all__ = ["MoE", "MoEStats", "Routing", "TopKRouter", "__version__"]
