"""ZeRO: partitioned optimizer state (stage 1), gradients (2) and parameters (3).

:class:`Init` builds a model already partitioned for stage 3 and
:class:`GatheredParameters` gives temporary full access to partitioned parameters.
"""

from zcore.zero.init import GatheredParameters, Init
from zcore.zero.layout import GroupLayout, ParamShard

__all__ = ["GatheredParameters", "GroupLayout", "Init", "ParamShard"]
