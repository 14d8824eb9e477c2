"""ZeRO: partitioned optimizer state (stage 1), gradients (2) and parameters (3).

:class:`Init` builds a model already partitioned for stage 3 and
:class:`GatheredParameters` gives temporary full access to partitioned parameters;
:func:`register_external_parameter` gathers a parameter around another module's use;
:func:`held_bytes` is what one rank holds of a parameter.
"""

from zcore.zero.init import GatheredParameters, Init
from zcore.zero.layout import GroupLayout, ParamShard
from zcore.zero.stage3 import held_bytes, register_external_parameter

__all__ = [
    "GatheredParameters",
    "GroupLayout",
    "Init",
    "ParamShard",
    "held_bytes",
    "register_external_parameter",
]
