"""zcore's process groups and how a failing collective is described."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from tests.utils.distributed import run_ranks
from zcore.comm import CollectiveError, Comm
from zcore.comm.groups import CUDA_BACKEND, backend_for


def _device_backends(backend: str) -> dict[str, str]:
    """How torch itself reads a backend string: device type -> backend."""
    return dict(BackendConfig(dist.Backend(backend)).get_device_backend_map())


def test_cuda_groups_have_gloo_for_cpu_tensors() -> None:
    # Comm reduces its scalars (gradient norm, overflow flags, barriers) as CPU tensors:
    # a pure "nccl" group has no backend for them
    assert _device_backends("nccl") == {"cuda": "nccl"}
    for device in (torch.device("cuda"), torch.device("cuda", 1), "cuda:0"):
        assert backend_for(device) == CUDA_BACKEND
    assert _device_backends(CUDA_BACKEND) == {"cpu": "gloo", "cuda": "nccl"}


def test_cpu_groups_are_gloo() -> None:
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for("cpu") == "gloo"


def _refused(rank: int, world: int) -> list[dict[str, Any]]:
    comm = Comm(dist.group.WORLD, rank, world, timeout_s=30)
    comm.step = 7
    # arguments gloo rejects before sending anything, on every rank alike
    bad = {
        "all_gather(too small)": lambda what: comm.all_gather(torch.zeros(3), torch.ones(2), what),
        "all_reduce(max of complex)": lambda what: comm.all_reduce(
            torch.zeros(2, dtype=torch.complex64), what, dist.ReduceOp.MAX
        ),
    }
    out = []
    for what, issue in bad.items():
        case: dict[str, Any] = {"what": what, "msg": "no error", "cause": None, "seconds": 0.0}
        start = time.monotonic()
        try:
            issue(what).wait()
        except CollectiveError as err:
            case["msg"], case["cause"] = str(err), err.__cause__
        case["seconds"] = time.monotonic() - start
        out.append(case)
    comm.barrier("barrier(after the refused collectives)")  # the group is still usable
    return out


def test_refused_collective_is_reported_as_itself_not_as_a_timeout() -> None:
    for rank, got in enumerate(run_ranks(_refused, 2, timeout=60)):
        for case, kind in zip(got, [RuntimeError, ValueError], strict=True):
            what, msg, cause = case["what"], case["msg"], case["cause"]
            assert type(cause) is kind, f"{what}: chained {cause!r}, expected a {kind.__name__}"
            head = f"rank {rank}/2: collective `{what}` at step 7 could not be started: "
            assert msg == f"{head}{kind.__name__}: {cause}", msg
            assert case["seconds"] < 10, f"{what} took {case['seconds']:.1f}s to be reported"


def test_cpu_tensor_on_a_group_without_cpu_backend_names_the_fix() -> None:
    # the error torch raises for a CPU tensor on a pure NCCL group (no GPU here to make one)
    cause = RuntimeError("No backend type associated with device type cpu")
    msg = str(Comm(None, 0, 2, 30).refused("all_reduce(gradient norm)", 3, cause))
    assert msg.startswith(
        "rank 0/2: collective `all_reduce(gradient norm)` at step 3 could not be started: "
        "RuntimeError: No backend type associated with device type cpu\n"
    ), msg
    assert f"backend={CUDA_BACKEND!r}" in msg, msg
