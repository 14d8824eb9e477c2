"""Expert parallelism on real gloo ranks equals the same layer at ep_size=1.

Each rank runs its own tokens through an ``ep_size=1`` layer holding every expert (the
reference) and through the expert-parallel layer holding only its ``num_experts / ep``
experts, loaded from the reference's state dict by global expert name. Outputs, ``l_aux``,
``exp_counts`` and the input and gate gradients must match the reference on every rank; an
expert's gradient must be the sum of the reference's gradients for that expert over the
ranks of its ``ep`` group (the all-to-all backward brings every peer's contribution). fp32,
``atol=rtol=1e-5``.
"""

from __future__ import annotations

import pytest
import torch

import zmoe
from tests.utils.distributed import run_ranks
from tests.zmoe.moe_utils import build
from zcore.comm.mesh import MeshSpec, job_mesh

CASES = {
    "top1": {"k": 1, "use_rts": False},
    "top2": {"k": 2, "top2_2nd_expert_sampling": False},
    "dropless": {"k": 2, "drop_tokens": False},
    "residual": {"k": 1, "drop_tokens": False, "use_residual": True},
}
TOKENS, D = 24, 16


def _grads(layer: zmoe.MoE, x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    out, l_aux, counts = layer(x)
    ((out * w).sum() + l_aux).backward()
    grads = {
        n: p.grad if p.grad is not None else torch.zeros_like(p)
        for n, p in layer.named_parameters()
    }
    return {"out": out.detach(), "l_aux": l_aux.detach(), "counts": counts, "x": x.grad, **grads}


def _check(rank: int, world: int, ep: int, experts: int) -> list[str]:
    mesh = job_mesh(MeshSpec.resolve(world, ep=ep), 60.0)
    torch.manual_seed(100 + rank)
    x, w = torch.randn(TOKENS, D), torch.randn(TOKENS, D)
    checked = []
    for name, kwargs in CASES.items():
        ref = build(experts=experts, **kwargs)
        layer = build(experts=experts, ep_size=ep, **kwargs)
        assert list(layer.experts) == [
            str(layer.ep_rank * (experts // ep) + i) for i in range(experts // ep)
        ]
        own = layer.state_dict()
        layer.load_state_dict({n: v for n, v in ref.state_dict().items() if n in own})
        with pytest.raises(RuntimeError, match="bind_mesh"):
            layer(x)
        layer.bind_mesh(mesh)
        want, got = _grads(ref, x, w), _grads(layer, x, w)
        for key in sorted(k for k in want if k.startswith("experts.")):
            # every expert's reference gradient summed over the ep group (every rank reduces
            # every expert, in one order), as the all-to-all backward sums the peers' parts
            mesh.comm("ep").all_reduce(want[key], "reference expert grads").wait()
        for key, value in got.items():
            torch.testing.assert_close(value, want[key], atol=1e-5, rtol=1e-5, msg=f"{name} {key}")
        stats = layer.last_stats
        assert stats is not None
        if not kwargs.get("drop_tokens", True):  # dropless: k*T*d*element size each way
            assert stats.dispatch_bytes == stats.combine_bytes == kwargs["k"] * TOKENS * D * 4
        checked.append(name)
    return checked


def _wrong_mesh(rank: int, world: int) -> str:
    layer = build(experts=4, ep_size=2)
    with pytest.raises(ValueError) as err:
        layer.bind_mesh(job_mesh(MeshSpec.resolve(world, ep=1), 60.0))
    return str(err.value)


def test_ep2_equals_ep1() -> None:
    for checked in run_ranks(_check, 2, args=(2, 4)):
        assert checked == list(CASES)


def test_bind_mesh_refuses_another_ep_size() -> None:
    for message in run_ranks(_wrong_mesh, 2):
        assert "size 1" in message and "ep_size 2" in message


@pytest.mark.slow
def test_ep4_equals_ep1() -> None:
    for checked in run_ranks(_check, 4, args=(4, 8)):
        assert checked == list(CASES)


@pytest.mark.slow
def test_ep2_of_four_ranks_equals_ep1() -> None:
    """ep 2 x edp 2: two expert groups, each of two ranks."""
    for checked in run_ranks(_check, 4, args=(2, 4)):
        assert checked == list(CASES)
