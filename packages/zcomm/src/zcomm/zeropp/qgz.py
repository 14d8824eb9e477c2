"""qgZ: a gradient bucket's reduce-scatter as two INT4 all-to-alls, intra-node then inter-node.

The bucket holds ``W`` equal chunks of ``C`` elements, chunk ``d`` owed to rank ``d`` of the
ZeRO axis (``W`` ranks on ``N`` nodes of ``L``; rank ``(n, i)`` is local index ``i`` of node
``n``, :mod:`.nodes`). As DeepSpeed's ``all_to_all_quant_reduce``:

1. intra-node: rank ``(m, j)`` sends each rank ``(m, i)`` of its node the chunks owed to
   ``(n, i)`` for every node ``n``, each chunk INT4-quantized on its own (blocks of
   :data:`QGZ_BLOCK`, one fp32 scale each). ``(m, i)`` dequantizes and sums them over ``j``:
   ``partial[n]``, node ``m``'s sum of chunk ``(n, i)``.
2. inter-node: ``(m, i)`` sends ``Q(partial[n])`` to ``(n, i)`` (the ranks with the same local
   index, one per node); ``(n, i)`` dequantizes and sums over ``m``: its chunk, summed over
   all ``W`` ranks.

Sums run in float32 in rank order, so the result is deterministic and equals
:func:`zcomm.zeropp.reference.reference_qgz` bit for bit. A stage with one participant is
skipped (no quantization: one node needs no inter-node stage). Each rank sends
``(L - 1) N`` INT4 chunks inside its node and ``N - 1`` across nodes: ``C / 2 + 4 C / block``
bytes each, against ``W - 1`` chunks of ``C`` 2- or 4-byte elements for a reduce-scatter.

Both stages run over the ZeRO axis's own comm as ``all_to_all_single`` with zero-length
splits to ranks outside the stage's group, so no process group beyond the mesh's is needed
(the mesh builds node groups only under hpZ). The first stage is issued asynchronously;
the rest runs when the bucket's handle is waited on. ``zeropp_loco_param`` adds LoCo's
error feedback to both stages (:mod:`.loco`).
"""

from __future__ import annotations

from typing import Any

import torch

from zcomm.zeropp.config import LocoConfig
from zcomm.zeropp.loco import LocoErrors
from zcomm.zeropp.nodes import NodeLayout
from zcomm.zeropp.wire import Then, pack_into, packet_bytes, unpack
from zcore.comm import Comm, Handle

QGZ_BITS = 4
QGZ_BLOCK = 512
"""Elements per quantization block of a gradient chunk (DeepSpeed's group: about one row)."""


class QuantizedReduceScatter:
    """qgZ's hierarchical INT4 reduce-scatter (module docstring), with optional LoCo.

    Args:
        node_size: ranks per node (nodes are runs of consecutive global ranks).
        loco: LoCo's settings, or None for no error feedback.
        block: elements per quantization block.
    """

    def __init__(
        self, node_size: int, loco: LocoConfig | None = None, block: int = QGZ_BLOCK
    ) -> None:
        self.node_size = node_size
        self.block = block
        self.loco = LocoErrors(loco, block) if loco is not None else None
        self._layouts: dict[int, NodeLayout] = {}
        self._count: dict[int, tuple[int, int]] = {}  # id(comm) -> (step, buckets so far)

    def layout(self, comm: Comm) -> NodeLayout:
        got = self._layouts.get(id(comm))
        if got is None:
            got = self._layouts[id(comm)] = NodeLayout.of_comm(comm, self.node_size)
        return got

    def _bucket_key(self, comm: Comm) -> str:
        """``axis:k`` for the ``k``-th bucket this comm reduces in the current step."""
        step, k = self._count.get(id(comm), (comm.step, 0))
        if step != comm.step:
            k = 0
        self._count[id(comm)] = (comm.step, k + 1)
        return f"{comm.axis or 'dp'}:{k}"

    # -- the collective ---------------------------------------------------------------------
    def reduce_scatter(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor, what: str) -> Handle:
        """Sum ``inp`` (``comm.size`` chunks) across ``comm``; this rank's chunk into ``out``."""
        if comm.group is None or comm.size == 1:
            return comm.reduce_scatter(out, inp, what)
        lay = self.layout(comm)
        w, c = comm.size, out.numel()
        n_nodes, local = lay.count, lay.local
        node, me = lay.place(comm.rank)
        key = self._bucket_key(comm)
        if self.loco is not None:
            self.loco.begin(key)
        x_WC = inp.view(w, c).to(torch.float32)
        # payload_LNC[j, n]: the chunk owed to rank (n, j); row j goes to local peer j
        order = [lay.nodes[n][j] for j in range(local) for n in range(n_nodes)]
        payload_LNC = x_WC[order].view(local, n_nodes, c)
        packet = packet_bytes(c, QGZ_BITS, self.block)
        got: dict[int, torch.Tensor] = {}
        if local == 1:  # one rank per node: nothing to reduce inside it
            handle: Handle = _Done(comm, what)
        else:
            sent = self._send(key, "intra", payload_LNC)
            mine = {lay.nodes[node][j]: sent[j] for j in range(local)}
            handle, got = _exchange(comm, mine, f"{what}: intra-node int4")

        def finish() -> None:
            if local == 1:
                partial_NC = payload_LNC[0].clone()
            else:
                partial_NC = torch.zeros(n_nodes, c, dtype=torch.float32, device=inp.device)
                for j in range(local):  # this node's ranks in local order
                    rows = got[lay.nodes[node][j]].view(n_nodes, packet)
                    for n in range(n_nodes):
                        partial_NC[n] += unpack(rows[n], QGZ_BITS, self.block, c)
            if n_nodes == 1:
                out.copy_(partial_NC[0])
                return
            sent2 = self._send(key, "inter", partial_NC.view(n_nodes, 1, c))
            peers = {lay.nodes[n][me]: sent2[n] for n in range(n_nodes)}
            h2, got2 = _exchange(comm, peers, f"{what}: inter-node int4")
            h2.wait()
            total_C = torch.zeros(c, dtype=torch.float32, device=inp.device)
            for n in range(n_nodes):  # the nodes in order
                total_C += unpack(got2[lay.nodes[n][me]], QGZ_BITS, self.block, c)
            out.copy_(total_C)

        return Then(comm, handle, finish)

    def _send(self, key: str, stage: str, payload_RKC: torch.Tensor) -> torch.Tensor:
        """Pack ``R`` peers' payloads of ``K`` chunks of ``C`` values, each chunk quantized on
        its own; with LoCo the stage's error is added first and updated after. Returns the
        ``(R, K * packet)`` bytes, row ``r`` for peer ``r``."""
        r, k, c = payload_RKC.shape
        packet = packet_bytes(c, QGZ_BITS, self.block)
        meant = payload_RKC.reshape(-1)
        error = None
        if self.loco is not None:
            error = self.loco.error(key, stage, meant.numel(), meant.device)
            meant = meant + error
        out = torch.empty(r * k, packet, dtype=torch.uint8, device=meant.device)
        sent = torch.empty_like(meant)
        for q in range(r * k):
            sent[q * c : (q + 1) * c] = pack_into(
                out[q], meant[q * c : (q + 1) * c], QGZ_BITS, self.block
            )
        if self.loco is not None and error is not None:
            self.loco.keep(key, stage, error, sent, meant)
        return out.view(r, k * packet)

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"loco": self.loco.state_dict()} if self.loco is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.loco is not None and "loco" in state:
            self.loco.load_state_dict(state["loco"])


class _Done(Handle):
    """A handle with nothing to wait for."""

    def __init__(self, comm: Comm, what: str) -> None:
        super().__init__(comm, None, what, comm.step)


def _exchange(
    comm: Comm, packets: dict[int, torch.Tensor], what: str
) -> tuple[Handle, dict[int, torch.Tensor]]:
    """Send ``packets[r]`` (uint8, all the same length) to comm rank ``r`` and receive as
    many bytes from each of those ranks (the stages are symmetric): one
    ``all_to_all_single`` over ``comm`` with zero-length splits to every other rank.
    The received packets are valid once the handle is waited on."""
    ranks = sorted(packets)
    size = packets[ranks[0]].numel()
    splits = [size if r in packets else 0 for r in range(comm.size)]
    send = torch.cat([packets[r] for r in ranks])
    recv = torch.empty_like(send)
    handle = comm.all_to_all_single(recv, send, splits, splits, what)
    rows = recv.view(len(ranks), size)
    return handle, {r: rows[i] for i, r in enumerate(ranks)}
