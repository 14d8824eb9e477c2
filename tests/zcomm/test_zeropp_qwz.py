"""qwZ's INT8 all-gather on real gloo ranks: every row equals that rank's input after the
readable quantize / dequantize round trip, bit for bit, on every rank, and the bytes sent
are one packet (codes + fp32 scales) per peer."""

from __future__ import annotations

import os

import pytest
import torch

from tests.utils.distributed import run_ranks
from zcomm.zeropp import quantized_all_gather
from zcomm.zeropp.qwz import QWZ_BITS
from zcomm.zeropp.reference import quantized
from zcomm.zeropp.wire import packet_bytes
from zcore.comm.mesh import MeshSpec, job_mesh

BLOCK = 16


def _shard(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(31 + rank)
    x = torch.randn(n, generator=gen) * 10 ** (rank - 1)  # ranks of very different scales
    x[::5] = 0.0
    return x.to(dtype)


def _gather(rank: int, world: int, n: int, dtype: torch.dtype) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    mesh = job_mesh(MeshSpec.resolve(world), 60.0)
    comm = mesh.comm("dp")
    out = torch.empty(world * n, dtype=dtype)
    before = mesh.traffic().ops["all_gather"]
    quantized_all_gather(comm, out, _shard(rank, n, dtype), "test gather", block=BLOCK).wait()
    after = mesh.traffic().ops["all_gather"]
    want = torch.cat(
        [quantized(_shard(r, n, dtype), QWZ_BITS, BLOCK).to(dtype) for r in range(world)]
    )
    exact = torch.cat([_shard(r, n, dtype) for r in range(world)]).float()
    return {
        "equal": torch.equal(out, want),
        "node_size": mesh.node_size,
        "sent": (after.intra - before.intra, after.inter - before.inter),
        "worst": float(
            (
                (out.float() - exact).abs().view(world, n).amax(1)
                / exact.abs().view(world, n).amax(1)
            ).max()
        ),
    }


@pytest.mark.parametrize(("world", "n", "dtype"), [(4, 37, torch.float32), (3, 48, torch.bfloat16)])
def test_rows_equal_the_round_trip_and_bytes_are_one_packet_per_peer(
    world: int, n: int, dtype: torch.dtype
) -> None:
    results = run_ranks(_gather, world, args=(n, dtype), timeout=120)
    packet = packet_bytes(n, QWZ_BITS, BLOCK)
    for rank, got in enumerate(results):
        assert got["equal"]
        node = got["node_size"]  # 2, or the whole job where 2 does not divide it
        peers_on_node = sum(r // node == rank // node for r in range(world)) - 1
        assert sum(got["sent"]) == (world - 1) * packet
        assert got["sent"][0] == peers_on_node * packet
        # INT8: within half a step (absmax / 254) of the exact value, plus bf16's rounding
        assert got["worst"] <= 1 / 254 + (2**-8 if dtype == torch.bfloat16 else 1e-6)
