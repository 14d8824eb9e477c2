"""The hybrid engine: the ZeRO-3 actor gathered into zserve's paged-KV runner for each rollout.

See :mod:`zchat.hybrid.engine` (the phases) and :mod:`zchat.hybrid.gather` (how the partitions
become zserve's weights without a second model copy).
"""

from zchat.hybrid.engine import Generation, HybridEngine, RolloutStats
from zchat.hybrid.gather import gather_full_weights

__all__ = ["Generation", "HybridEngine", "RolloutStats", "gather_full_weights"]
