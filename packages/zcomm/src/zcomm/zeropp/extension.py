"""What ZeRO++ adds to zcore, registered on import (zcore imports this module through the
``zcore.extensions`` entry point when a config names one of its keys or an engine starts)."""

from __future__ import annotations

from zcomm.zeropp.collectives import zeropp_collectives
from zcomm.zeropp.config import KEYS
from zcore.config import register_feature
from zcore.zero.collectives import register_collectives

for _key in KEYS:
    register_feature(_key)
register_collectives("zeropp", zeropp_collectives)
