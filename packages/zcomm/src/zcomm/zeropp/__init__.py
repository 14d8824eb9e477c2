"""ZeRO++ (qwZ, hpZ, qgZ, LoCo) as zcore collectives, switched on by DeepSpeed's keys.

- :mod:`.qwz`: stage-3 weight gathers as INT8 blocks (``zero_quantized_weights``);
- :mod:`.hpz`: a node-local secondary copy for backward gathers (``zero_hpz_partition_size``);
- :mod:`.qgz`: gradient reduce-scatter as INT4 intra- then inter-node all-to-alls
  (``zero_quantized_gradients``), :mod:`.loco` its error feedback (``zeropp_loco_param``);
- :mod:`.collectives`: the plug-in composing them and its factory, registered as
  ``"zeropp"`` by :mod:`.extension` (loaded through the ``zcore.extensions`` entry point);
- :mod:`.reference`: a single-process model of qgZ's reduction that the tests hold the
  distributed one to, bit for bit.

Everything is pure torch over zcore's ``Comm``, so it runs on gloo (CPU) and NCCL alike.
"""

from zcomm.zeropp.collectives import ZeroPP, zeropp_collectives
from zcomm.zeropp.config import LocoConfig, ZeroPPConfig
from zcomm.zeropp.hpz import SecondaryPartition
from zcomm.zeropp.nodes import NodeLayout
from zcomm.zeropp.qgz import QuantizedReduceScatter
from zcomm.zeropp.qwz import quantized_all_gather

__all__ = [
    "LocoConfig",
    "NodeLayout",
    "QuantizedReduceScatter",
    "SecondaryPartition",
    "ZeroPP",
    "ZeroPPConfig",
    "quantized_all_gather",
    "zeropp_collectives",
]
