"""Where the ranks of one comm sit: ``nodes x local`` for qgZ's two-stage all-to-all.

A node is a run of ``node_size`` consecutive global ranks (:attr:`zcore.comm.Mesh.node_size`:
hpZ's ``dp_local`` when it is on, else the launcher's ``LOCAL_WORLD_SIZE``). qgZ reduces
first among the ranks of one node, then across nodes among the ranks with the same local
index, which needs every node to hold the same number of the comm's ranks. A comm whose
ranks do not split evenly is treated as one node (a single-stage all-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from zcore.comm import Comm


@dataclass(frozen=True)
class NodeLayout:
    """``nodes[n][i]``: the comm rank with local index ``i`` on the comm's ``n``-th node."""

    nodes: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        """Nodes the comm spans."""
        return len(self.nodes)

    @property
    def local(self) -> int:
        """The comm's ranks on each node."""
        return len(self.nodes[0])

    def place(self, rank: int) -> tuple[int, int]:
        """``(node, local index)`` of comm rank ``rank``."""
        for n, members in enumerate(self.nodes):
            if rank in members:
                return n, members.index(rank)
        raise ValueError(f"rank {rank} is not in {self.nodes}")

    @classmethod
    def even(cls, nodes: int, local: int) -> NodeLayout:
        """``nodes`` nodes of ``local`` consecutive ranks each (comm rank = global rank)."""
        return cls(tuple(tuple(range(n * local, (n + 1) * local)) for n in range(nodes)))

    @classmethod
    def of(cls, global_ranks: list[int], node_size: int) -> NodeLayout:
        """The layout of a comm whose rank ``r`` is global rank ``global_ranks[r]``."""
        by_node: dict[int, list[int]] = {}
        for r, g in enumerate(global_ranks):
            by_node.setdefault(g // node_size, []).append(r)
        groups = list(by_node.values())
        if len({len(g) for g in groups}) != 1:
            return cls((tuple(range(len(global_ranks))),))
        return cls(tuple(tuple(g) for g in groups))

    @classmethod
    def of_comm(cls, comm: Comm, node_size: int) -> NodeLayout:
        """The layout of ``comm`` (one node on a single process)."""
        if comm.group is None or comm.size == 1:
            return cls(((0,),))
        return cls.of(list(dist.get_process_group_ranks(comm.group)), node_size)
