"""qgZ's hierarchical INT4 reduce-scatter, every rank simulated in one process.

The readable model :class:`zcomm.zeropp.qgz.QuantizedReduceScatter` is tested against: the
same quantizer, the same per-chunk blocks, the same float32 sums in the same order, so the
distributed result must equal this one bit for bit. Written as loops over ranks, not as
the collective's buffers and splits.
"""

from __future__ import annotations

import torch

from zcomm.blockquant import dequantize_blocks, quantize_blocks
from zcomm.zeropp.config import LocoConfig
from zcomm.zeropp.nodes import NodeLayout
from zcomm.zeropp.qgz import QGZ_BITS, QGZ_BLOCK


def quantized(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """``x`` after a quantize / dequantize round trip (float32)."""
    codes, scales = quantize_blocks(x, bits, block)
    return dequantize_blocks(codes, scales, bits, block, x.numel())


def reference_qgz(
    inputs: list[torch.Tensor],
    layout: NodeLayout,
    block: int = QGZ_BLOCK,
    loco: LocoConfig | None = None,
    errors: list[dict[str, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """Each rank's reduced chunk when rank ``r`` reduce-scatters ``inputs[r]``.

    ``errors`` (with ``loco``): one dict per rank with its ``"intra"`` / ``"inter"`` error
    (float32, as stored), updated in place; a missing entry starts from zeros.
    """
    w = len(inputs)
    c = inputs[0].numel() // w
    nodes, n_nodes, local = layout.nodes, layout.count, layout.local

    def chunk(src: int, dst: int) -> torch.Tensor:
        return inputs[src].reshape(w, c)[dst].to(torch.float32)

    def send(rank: int, stage: str, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """What ``rank`` puts on the wire for ``values`` (one chunk each), with LoCo."""
        meant = torch.cat(values)
        if loco is not None and errors is not None:
            error = errors[rank].get(stage, torch.zeros_like(meant))
            meant = meant + error
        sent = torch.cat(
            [quantized(meant[k * c : (k + 1) * c], QGZ_BITS, block) for k in range(len(values))]
        )
        if loco is not None and errors is not None:
            beta = loco.err_beta
            new = beta * error + (1.0 - beta) * (meant - sent)
            errors[rank][stage] = quantized(new, 8, block)
        return list(sent.split(c))

    # stage 1: partial[(m, i)][n] = node m's sum of the chunk owed to rank (n, i)
    partial = {r: [torch.zeros(c) for _ in range(n_nodes)] for r in range(w)}
    for m in range(n_nodes):
        for j in range(local):  # senders in local order
            sender = nodes[m][j]
            if local == 1:
                partial[sender] = [chunk(sender, nodes[n][0]) for n in range(n_nodes)]
                continue
            wire = send(
                sender,
                "intra",
                [chunk(sender, nodes[n][i]) for i in range(local) for n in range(n_nodes)],
            )
            for i in range(local):
                for n in range(n_nodes):
                    partial[nodes[m][i]][n] += wire[i * n_nodes + n]
    if n_nodes == 1:
        return [partial[r][0] for r in range(w)]
    # stage 2: rank (n, i) sums, over nodes m in order, what (m, i) sent it
    out = [torch.zeros(c) for _ in range(w)]
    for m in range(n_nodes):
        for i in range(local):
            sender = nodes[m][i]
            wire = send(sender, "inter", partial[sender])
            for n in range(n_nodes):
                out[nodes[n][i]] += wire[n]
    return out
