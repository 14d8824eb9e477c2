"""The compressed all-reduce on real gloo ranks equals the single-process reference exactly.

Every rank draws every rank's inputs from the same seeds, so each can run the reference for
the whole job and compare its own output and error buffers with it, call after call (the
error feedback carries from one call to the next).
"""

from __future__ import annotations

import pytest
import torch

from tests.utils.distributed import run_ranks
from zcomm import (
    CompressedAllReduce,
    ErrorFeedbackReset,
    reference_compressed_allreduce,
    wire_bytes,
)
from zcomm.compressed import padded_numel
from zcore.comm import Comm
from zcore.comm.mesh import MeshSpec, job_mesh

# Shapes whose sizes need padding at world 2, 3 and 4 (multiples of 16, 72 and 32; world 3
# pads to 3 * lcm(3, 8) as DeepSpeed does and averages with * (1 / 3)), one that needs
# none at world 2 and 4 (64), and one with exact zeros (signs +1).
SHAPES = [(1,), (7,), (33,), (4, 25), (64,), (3, 100)]
CALLS = 4


def _inputs(shape: tuple[int, ...], call: int, world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * call + sum(shape))
    xs = [torch.randn(shape, generator=gen) for _ in range(world)]
    if shape == (4, 25):
        for x in xs:
            x.view(-1)[::3] = 0.0
    return xs


def _check(rank: int, world: int) -> list[str]:
    comm = job_mesh(MeshSpec.resolve(world), 60.0).comm("dp")
    reducer = CompressedAllReduce(comm)
    failures: list[str] = []
    reference = {shape: (None, None) for shape in SHAPES}

    def step(call: int, shape: tuple[int, ...], restored: CompressedAllReduce | None) -> None:
        xs = _inputs(shape, call, world)
        key = str(shape)
        out = reducer(xs[rank], key)
        outs, workers, servers = reference_compressed_allreduce(xs, *reference[shape])
        reference[shape] = (workers, servers)
        ef = reducer.errors[key]
        where = f"rank {rank}/{world} shape {shape} call {call}"
        if not (out.shape == xs[rank].shape and torch.equal(out, outs[rank])):
            failures.append(f"{where}: output differs by {(out - outs[rank]).abs().max()}")
        if not torch.equal(ef.worker, workers[rank]):
            failures.append(f"{where}: worker error differs")
        if not torch.equal(ef.server, servers[rank]):
            failures.append(f"{where}: server error differs")
        expected = wire_bytes(xs[rank].numel(), world)
        if reducer.last_bytes != expected:
            failures.append(f"{where}: sent {reducer.last_bytes}, formula {expected}")
        if restored is not None and not torch.equal(restored(xs[rank], key), out):
            failures.append(f"{where}: the reducer restored from state_dict diverged")

    for call in range(CALLS // 2):
        for shape in SHAPES:
            step(call, shape, None)
    restored = CompressedAllReduce(comm)
    restored.load_state_dict(reducer.state_dict())
    for call in range(CALLS // 2, CALLS):
        for shape in SHAPES:
            step(call, shape, restored)
    total = CALLS * sum(wire_bytes(torch.Size(s).numel(), world).total for s in SHAPES)
    if reducer.bytes_sent != total:
        failures.append(f"rank {rank}: bytes_sent {reducer.bytes_sent}, expected {total}")
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_equals_reference_on_gloo_ranks(world: int) -> None:
    for failures in run_ranks(_check, world):
        assert failures == []


def test_byte_formula() -> None:
    # N = n padded to a multiple of world * lcm(world, 8); phase 1 sends N/8 sign bytes and a
    # 4-byte scale per rank, phase 2 N/(8 world) sign bytes and one scale.
    for n, world, padded in [(1, 2, 16), (33, 2, 48), (64, 4, 64), (100, 4, 128), (5, 3, 72)]:
        assert padded_numel(n, world) == padded
        sent = wire_bytes(n, world)
        assert sent.phase1 == padded // 8 + 4 * world
        assert sent.phase2 == padded // (8 * world) + 4
    # Against the 4n bytes an fp32 all-reduce takes: about 1/32 + 1/(32 world).
    n = 1 << 20
    assert wire_bytes(n, 4).total == n // 8 + 4 * 4 + n // 32 + 4
    assert wire_bytes(n, 4).total / (4 * n) < 0.04
    assert wire_bytes(0, 4).total == 0


def test_error_feedback_telescopes() -> None:
    # Output = mean(input) + mean(old worker errors) - mean(new worker errors, per chunk)
    # + old server error - new server error, so over T calls the outputs sum to the true
    # means' sum minus only the final errors: compression error does not accumulate.
    world, n, calls = 4, 50, 6
    gen = torch.Generator().manual_seed(0)
    errors: tuple[list[torch.Tensor] | None, list[torch.Tensor] | None] = (None, None)
    out_sum = torch.zeros(n, dtype=torch.float64)
    true_sum = torch.zeros(n, dtype=torch.float64)
    for _ in range(calls):
        xs = [torch.randn(n, generator=gen) for _ in range(world)]
        outs, workers, servers = reference_compressed_allreduce(xs, *errors)
        errors = (workers, servers)
        assert all(torch.equal(o, outs[0]) for o in outs)
        out_sum += outs[0].double()
        true_sum += torch.stack(xs).double().mean(0)
    final = torch.stack(errors[0]).double().mean(0) + torch.cat(errors[1]).double()
    assert torch.allclose(out_sum, true_sum - final[:n], atol=1e-4)


def test_single_rank_and_empty() -> None:
    reducer = CompressedAllReduce(Comm(None, 0, 1, 10.0))
    x = torch.randn(20, generator=torch.Generator().manual_seed(5))
    out = reducer(x)
    assert torch.equal(out, reference_compressed_allreduce([x])[0][0])
    assert reducer(torch.zeros(0), "empty").numel() == 0 and reducer.last_bytes.total == 0
    with pytest.raises(ValueError, match="got 21 elements, but its error buffers were made for 20"):
        reducer(torch.randn(21))


def test_load_at_another_world_size_starts_from_zero() -> None:
    at_two = CompressedAllReduce(Comm(None, 0, 1, 10.0))
    at_two(torch.randn(20))
    state = at_two.state_dict()
    state["world"] = 2
    state["errors"]["default"]["server"] = torch.zeros(16)
    at_one = CompressedAllReduce(Comm(None, 0, 1, 10.0))
    with pytest.warns(ErrorFeedbackReset, match="saved at world 2"):
        at_one.load_state_dict(state)
    assert at_one.errors == {}
