"""How ZeRO moves gradients and parameters: the collectives seam.

ZeRO issues three kinds of bulk collective: a gradient bucket's reduce-scatter (or
all-reduce) during backward, and the all-gather of parameters (stage 3's shards before a
module runs; stages 1-2's updated weights after a step). :class:`Collectives` is the small
interface they go through; the default sends full precision over the axis's
:class:`~zcore.comm.Comm`, so its timeout and rank/op/step messages hold for every plug-in.

A package that compresses them (zcomm: qgZ, qwZ) registers a factory under a name::

    from zcore.zero.collectives import register_collectives
    register_collectives("qgz", lambda config, mesh: QgZ(config) if <config asks> else None)

The engine asks every registered factory (installed packages are found through the
``zcore.extensions`` entry point) and uses the one that claims the config; two claiming
it is an error naming both. Collectives are independent of where the optimizer state lives,
so any of them combines with CPU or NVMe offload. State that must survive a restart (error
feedback buffers) goes through :meth:`Collectives.state_dict`.

Stage 3's parameter gathers have three more hooks: :meth:`Collectives.gather_params` carries
them (qwZ sends them quantized), :meth:`Collectives.gather_source` says which comm and which
piece of a parameter a gather reads (hpZ: backward gathers read a node-local secondary
piece), and :meth:`Collectives.param_gathered` hands over each full value stage 3 obtains
(hpZ cuts that secondary piece from it). Their defaults leave the gathers as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zcore.comm import Comm, Handle
from zcore.config.features import load_extensions


class Collectives:
    """Full-precision collectives (the default); plug-ins override the public methods."""

    name = "full"
    scatter_layout = False
    """True when this plug-in's gradient reduction is a reduce-scatter (qgZ's all-to-all):
    the engine then uses the reduce-scatter bucket layout on gloo too, where it otherwise
    all-reduces the buckets (gloo's all-reduce is faster than its reduce-scatter)."""

    def reduce_scatter(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        """Sum ``inp`` (``comm.size`` equal chunks) across ``comm``; this rank's chunk to ``out``."""
        return comm.reduce_scatter(out, inp, what)

    def all_reduce(self, comm: Comm, buf: torch.Tensor, what: str) -> Handle:
        """Sum ``buf`` across ``comm`` in place."""
        return comm.all_reduce(buf, what)

    def all_gather(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        """Every rank's ``inp``, in rank order, into ``out``."""
        return comm.all_gather(out, inp, what)

    # -- stage 3's parameter gathers (ZeRO++ qwZ and hpZ plug in here) -------------------
    def gather_params(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        """Stage 3's gather of parameter shards before a module uses them (qwZ quantizes it;
        the optimizer's gathers of updated weights stay :meth:`all_gather`)."""
        return self.all_gather(comm, out, inp, what)

    def gather_source(
        self, p: nn.Parameter, full_comm: Comm, backward: bool
    ) -> tuple[Comm, torch.Tensor] | None:
        """Where a stage-3 gather of ``p`` reads from: ``(comm, this rank's piece)``, the
        pieces cut like the shards (``ceil(numel / comm.size)`` elements each, zero-padded).
        None (the default): ``full_comm`` and the stored shard. hpZ answers the node-local
        comm and its secondary piece for backward gathers."""
        return None

    def param_gathered(self, p: nn.Parameter, full_comm: Comm, full: torch.Tensor) -> None:
        """Stage 3 holds ``p``'s full current value ``full`` (after a forward gather or an
        edit): hpZ cuts its secondary piece from it. Nothing by default."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of these collectives (error feedback); none by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` gave."""


#: ``factory(config, mesh)`` → a :class:`Collectives` when ``config`` asks for it, else None.
CollectivesFactory = Callable[[Any, Any], Collectives | None]

_FACTORIES: dict[str, CollectivesFactory] = {}


def register_collectives(name: str, factory: CollectivesFactory) -> None:
    """Offer ``factory``'s collectives under ``name`` (registering a name again replaces it)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_collectives: name must be a non-empty string, got {name!r}")
    _FACTORIES[name] = factory


def unregister_collectives(name: str) -> None:
    """Withdraw ``name`` (tests, mostly); unknown names are ignored."""
    _FACTORIES.pop(name, None)


def collectives_for(config: Any, mesh: Any) -> Collectives:
    """The collectives ``config`` asks for: the one registered factory that claims it, or
    full precision. Raises ValueError when more than one claims it."""
    load_extensions()
    claims = [(n, c) for n, f in _FACTORIES.items() if (c := f(config, mesh)) is not None]
    if len(claims) > 1:
        names = ", ".join(f"`{n}`" for n, _ in claims)
        raise ValueError(
            f"{len(claims)} collectives claim this config ({names}); turn off all but one of "
            "the features that select them"
        )
    return claims[0][1] if claims else Collectives()
