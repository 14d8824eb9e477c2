"""Byte accounting: what each collective makes this rank send, intra-node vs inter-node.

Every collective issued through a :class:`~zcore.comm.Comm` adds the bytes this rank sends
to each other rank of its group, split by whether that peer is on this rank's node (nodes
are runs of ``node_size`` consecutive global ranks: :attr:`~zcore.comm.Mesh.node_size`).
Compressed communication (1-bit optimizers, ZeRO++) is judged by these numbers, so they
count what the backend is handed, not what an algorithm inside it might forward on.

The model, per call on a group of ``w`` ranks, ``n`` the bytes of the tensor handed over
(each peer is charged separately and lands in ``intra`` or ``inter`` by its node):

* ``all_gather(out, inp)``: ``inp`` to each of the ``w - 1`` peers.
* ``reduce_scatter(out, inp)``: chunk ``r`` of ``inp`` (``n / w``) to rank ``r``.
* ``all_reduce(t)``: a reduce-scatter then an all-gather: chunk ``r`` to rank ``r``, then
  this rank's reduced chunk to every peer; ``2 (w - 1) / w * n`` in all. Chunks are the
  even split of the elements (the first ``numel % w`` chunks one element longer), so the
  counts are exact integers for any size. Scalar reductions (barriers, flags, norms) are
  all-reduces of one element and count as such.
* ``all_to_all_single(out, inp, out_splits, in_splits)``: exactly block ``r`` of ``inp``
  (``in_splits[r]`` rows, or ``rows / w``) to rank ``r``; uneven splits count exactly.
* ``broadcast(t, src)``: the source sends ``t`` to each peer; the others send nothing.

Nothing is charged for this rank's own chunk, for a group of one, or for a single process.
Ring or tree algorithms inside gloo/NCCL route the same volume differently (a ring
all-reduce also sends ``2 (w - 1) / w * n``, but to one neighbour); the split here is by
destination, which is what a link between nodes has to carry in the direct schedule.

:class:`~zcomm.compressed.CompressedAllReduce` goes through two of these collectives
(an ``all_to_all_single`` of ``w`` rows of ``C / 8 + 4`` bytes, then an ``all_gather`` of
``C / 8 + 4`` bytes), so it is charged ``2 (w - 1) (C / 8 + 4)`` per call: phase 1 of its
``wire_bytes`` times ``(w - 1) / w`` (its own row stays) plus phase 2 times ``w - 1``.

Counting costs a few integer operations per collective: sizes come from
``numel() * element_size()``, never from tensor ops.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

#: The op kinds a :class:`Comm` counts, in report order.
OP_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")


@dataclass
class Traffic:
    """Bytes sent by one rank: to peers on its node (``intra``) and on other nodes (``inter``)."""

    intra: int = 0
    inter: int = 0

    @property
    def total(self) -> int:
        return self.intra + self.inter

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.intra + other.intra, self.inter + other.inter)

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.intra - other.intra, self.inter - other.inter)

    def as_dict(self) -> dict[str, int]:
        return {"intra": self.intra, "inter": self.inter, "total": self.total}


@dataclass
class TrafficTally:
    """Traffic per op kind (``OP_KINDS``), summed over some comms; :meth:`minus` gives a delta."""

    ops: dict[str, Traffic] = field(default_factory=lambda: {k: Traffic() for k in OP_KINDS})

    @property
    def total(self) -> Traffic:
        out = Traffic()
        for t in self.ops.values():
            out = out + t
        return out

    def add(self, ops: dict[str, Traffic]) -> None:
        """Add another comm's per-op counts (its ``traffic``)."""
        for kind, t in ops.items():
            self.ops[kind] = self.ops.get(kind, Traffic()) + t

    def minus(self, before: TrafficTally) -> TrafficTally:
        """What was sent since ``before`` (an earlier tally of the same comms)."""
        return TrafficTally({k: t - before.ops.get(k, Traffic()) for k, t in self.ops.items()})

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{"all_reduce": {"intra", "inter", "total"}, ..., "total": {...}}``."""
        return {**{k: t.as_dict() for k, t in self.ops.items()}, "total": self.total.as_dict()}


def env_node_size(world: int) -> int:
    """Ranks per node from the launcher (``LOCAL_WORLD_SIZE``) when it divides ``world``,
    else ``world`` (one node): the default for a :class:`Comm` made outside a mesh."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return local if local > 0 and world % local == 0 else world


class Ledger:
    """The running per-op :class:`Traffic` of one rank in one group (see the module docstring).

    ``ranks`` are the group's global ranks in group order, ``me`` this rank's index in the
    group, ``node_size`` the ranks per node (nodes: runs of consecutive global ranks).
    """

    def __init__(self, ranks: Sequence[int], me: int, node_size: int) -> None:
        if node_size < 1:
            raise ValueError(f"node_size must be a positive integer, got {node_size}")
        if not 0 <= me < len(ranks):
            raise ValueError(f"rank {me} is not in a group of {len(ranks)} ranks")
        mine = ranks[me] // node_size
        self.me = me
        self.size = len(ranks)
        self.intra_peer: tuple[bool, ...] = tuple(g // node_size == mine for g in ranks)
        """Per group rank: whether it is on this rank's node (this rank itself included)."""
        self.n_intra = sum(self.intra_peer) - 1
        """Peers (other ranks of the group) on this rank's node."""
        self.n_inter = self.size - 1 - self.n_intra
        self.ops: dict[str, Traffic] = {k: Traffic() for k in OP_KINDS}

    def _uniform(self, kind: str, per_peer: int) -> None:
        t = self.ops[kind]
        t.intra += per_peer * self.n_intra
        t.inter += per_peer * self.n_inter

    def _per_peer(self, kind: str, sizes: Sequence[int]) -> None:
        intra = inter = 0
        for r, (b, near) in enumerate(zip(sizes, self.intra_peer, strict=True)):
            if r == self.me:
                continue
            if near:
                intra += b
            else:
                inter += b
        t = self.ops[kind]
        t.intra += intra
        t.inter += inter

    def all_gather(self, in_bytes: int) -> None:
        self._uniform("all_gather", in_bytes)

    def reduce_scatter(self, in_bytes: int) -> None:
        self._uniform("reduce_scatter", in_bytes // self.size)

    def all_reduce(self, numel: int, element_size: int) -> None:
        w = self.size
        q, rem = divmod(numel, w)
        own = (q + (self.me < rem)) * element_size
        if rem == 0:
            self._uniform("all_reduce", q * element_size + own)
        else:
            self._per_peer("all_reduce", [(q + (r < rem)) * element_size + own for r in range(w)])

    def all_to_all(self, in_bytes: int, rows: int, in_splits: Sequence[int] | None) -> None:
        if rows == 0:
            return
        row_bytes = in_bytes // rows
        if in_splits is None:
            self._uniform("all_to_all", rows // self.size * row_bytes)
        else:
            self._per_peer("all_to_all", [s * row_bytes for s in in_splits])

    def broadcast(self, nbytes: int, src: int) -> None:
        if src == self.me:
            self._uniform("broadcast", nbytes)
