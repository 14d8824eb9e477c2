"""ZeRO++ as zcore collectives: qwZ, hpZ and qgZ composed behind one plug-in.

zcore's ZeRO sends everything through a :class:`~zcore.zero.collectives.Collectives`;
:class:`ZeroPP` overrides only what the config turns on and leaves the rest full precision:

============================  ==========================================================
stage-3 parameter gathers     qwZ: INT8 codes + scales (:mod:`.qwz`)
backward gathers              hpZ: from the node-local secondary copy over ``dp_local``
                              (:mod:`.hpz`), quantized too when qwZ is on
gradient reduce-scatter       qgZ: INT4 intra-node then inter-node all-to-all
                              (:mod:`.qgz`), LoCo error feedback with ``zeropp_loco_param``
optimizer's weight gathers,   full precision (as DeepSpeed's persistent-parameter and
replica all-reduces           MiCS paths)
============================  ==========================================================

:func:`zeropp_collectives` is the factory registered as ``"zeropp"``; it claims a config
that turns any of qwZ, hpZ, qgZ on, after checking the combination (:mod:`.config`).
Where the optimizer state lives is independent of all this, so CPU and NVMe offload
combine with any of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zcomm.zeropp.config import HPZ, ZeroPPConfig
from zcomm.zeropp.hpz import SecondaryPartition
from zcomm.zeropp.qgz import QuantizedReduceScatter
from zcomm.zeropp.qwz import quantized_all_gather
from zcore.comm import Comm, Handle
from zcore.config import ConfigError
from zcore.zero.collectives import Collectives


class ZeroPP(Collectives):
    """The ZeRO++ parts ``config`` turns on, over ``mesh`` (a :class:`zcore.comm.Mesh`)."""

    name = "zeropp"

    def __init__(self, config: ZeroPPConfig, mesh: Any) -> None:
        self.config = config
        self.scatter_layout = config.quantized_gradients
        self.qgz = (
            QuantizedReduceScatter(mesh.node_size, config.loco)
            if config.quantized_gradients
            else None
        )
        self.hpz = None
        if config.hpz_partition_size > 1:
            local = int(mesh.spec.dp_local)
            if local != config.hpz_partition_size:
                raise ConfigError.single(
                    HPZ,
                    config.hpz_partition_size,
                    f"the mesh's node-local axis dp_local is {local}, so this zcore did not "
                    "size it from the key; upgrade zcore together with zcomm",
                )
            self.hpz = SecondaryPartition(mesh.comm("dp"), mesh.comm("dp_local"))

    def reduce_scatter(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        if self.qgz is not None:
            return self.qgz.reduce_scatter(comm, out, inp, what)
        return super().reduce_scatter(comm, out, inp, what)

    def gather_params(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        if self.config.quantized_weights:
            return quantized_all_gather(comm, out, inp, what)
        return super().gather_params(comm, out, inp, what)

    def gather_source(
        self, p: nn.Parameter, full_comm: Comm, backward: bool
    ) -> tuple[Comm, torch.Tensor] | None:
        return self.hpz.source(p, full_comm, backward) if self.hpz is not None else None

    def param_gathered(self, p: nn.Parameter, full_comm: Comm, full: torch.Tensor) -> None:
        if self.hpz is not None:
            self.hpz.keep(p, full_comm, full)

    def state_dict(self) -> dict[str, Any]:
        """qgZ's LoCo error buffers (empty without LoCo)."""
        state = self.qgz.state_dict() if self.qgz is not None else {}
        return {"qgz": state} if state else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.qgz is not None and "qgz" in state:
            self.qgz.load_state_dict(state["qgz"])


def zeropp_collectives(config: Any, mesh: Any) -> ZeroPP | None:
    """The ``"zeropp"`` factory: :class:`ZeroPP` when ``config`` turns any part on, else None.

    Raises :class:`~zcore.config.ConfigError` for a combination that cannot run."""
    zpp = ZeroPPConfig.from_config(config)
    return ZeroPP(zpp, mesh) if zpp.enabled else None
