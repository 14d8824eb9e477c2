"""zmoe.MoE on one process: configuration errors, losses, statistics, naming, routers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zmoe
from tests.zmoe.moe_utils import build, mlp, seed_experts


@pytest.mark.parametrize(
    ("kwargs", "numbers"),
    [
        ({"num_experts": 6, "ep_size": 4}, ["num_experts 6", "ep_size 4"]),
        ({"num_experts": 4, "k": 5}, ["k 5", "num_experts 4"]),
        ({"num_experts": 4, "capacity_factor": 0.0}, ["capacity_factor 0.0"]),
        ({"num_experts": 4, "eval_capacity_factor": -1.0}, ["eval_capacity_factor -1.0"]),
        ({"num_experts": 4, "ep_size": 2}, ["ep_size 2", "world size 1"]),
        ({"num_experts": 4, "router": "relu"}, ["'relu'"]),
        ({"num_experts": 4, "noisy_gate_policy": "Gauss"}, ["'Gauss'"]),
    ],
)
def test_bad_config_names_the_numbers(kwargs: dict, numbers: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        zmoe.MoE(8, mlp(8, 8), **kwargs)
    for number in numbers:
        assert number in str(err.value)


def test_experts_are_named_by_global_index_and_tagged() -> None:
    layer = build(experts=4, use_residual=True)
    assert list(layer.experts) == ["0", "1", "2", "3"]
    for name, p in layer.named_parameters():
        assert getattr(p, "zero_axis", None) == ("edp" if name.startswith("experts.") else None)
    assert layer.mesh_axes() == {"ep": 1}
    assert "experts.3.2.weight" in layer.state_dict()


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_aux_and_z_loss_reach_the_gate(router: str) -> None:
    layer = build(k=2, z_loss_coef=1e-2, router=router)
    x = torch.randn(64, 16)
    _, l_aux, _ = layer(x)
    l_aux.backward()
    grad = layer.gate.wg.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    stats = layer.last_stats
    assert stats is not None and stats.z_loss > 0
    torch.testing.assert_close(l_aux.detach(), stats.aux_loss + 1e-2 * stats.z_loss)
    # the z-loss alone also reaches the gate
    layer.zero_grad()
    layer.z_loss_coef = 1.0
    layer.gate.wg.weight.grad = None
    _, l_aux, _ = layer(x)
    (l_aux - layer.last_stats.aux_loss).backward()  # type: ignore[union-attr]
    assert layer.gate.wg.weight.grad.abs().sum() > 0  # type: ignore[union-attr]


def test_capacity_drops_are_counted() -> None:
    layer = build(k=1, capacity_factor=0.5, min_capacity=1, use_rts=False)
    x = torch.randn(64, 16)
    out, _, counts = layer(x)
    stats = layer.last_stats
    assert stats is not None
    assert stats.capacity == 8  # ceil(64 / 4 * 0.5)
    assert stats.expert_load.tolist() == counts.clamp(max=8).tolist()
    assert stats.dropped_routes == int((counts - 8).clamp(min=0).sum())
    assert 0 < stats.dropped_fraction == stats.dropped_routes / 64
    dropped = (out == 0).all(dim=1)  # a token whose only route was dropped outputs zeros
    assert int(dropped.sum()) == stats.dropped_routes


@pytest.mark.parametrize("k", [1, 2, 3])
def test_ample_capacity_equals_dropless(k: int) -> None:
    capped = build(k=k, capacity_factor=8.0, use_rts=False)
    free = build(k=k, drop_tokens=False)
    x = torch.randn(48, 16)
    torch.testing.assert_close(capped(x)[0], free(x)[0], atol=1e-5, rtol=1e-5)
    assert free.last_stats is not None and free.last_stats.dropped_fraction == 0.0
    assert capped.last_stats is not None and capped.last_stats.dropped_fraction == 0.0


def test_sigmoid_router_weights() -> None:
    layer = build(k=2, router="sigmoid", drop_tokens=False)
    x = torch.randn(8, 16)
    routing = layer.gate(x)
    scores = torch.sigmoid(x @ layer.gate.wg.weight.t())
    top, idx = scores.topk(2, dim=1)
    assert torch.equal(routing.indices, idx)
    torch.testing.assert_close(routing.gates, top / top.sum(dim=1, keepdim=True))


def test_aux_loss_free_bias_moves_against_the_load() -> None:
    layer = build(k=1, drop_tokens=False, aux_loss_free_bias=True, bias_update_rate=0.1)
    with torch.no_grad():
        layer.gate.wg.weight[0] += 1.0  # expert 0 attracts most tokens
    x = torch.randn(256, 16).abs()
    _, _, first = layer(x)
    bias = layer.gate.expert_bias.clone()
    assert bias[0] < 0 and (bias[first < first.float().mean()] > 0).all()
    for _ in range(30):
        _, _, counts = layer(x)
    assert counts.max() < first.max()  # the bias spread the load
    assert "gate.expert_bias" in layer.state_dict()
    layer.eval()
    before = layer.gate.expert_bias.clone()
    layer(x)
    assert torch.equal(layer.gate.expert_bias, before)  # no update in eval


def test_residual_mixes_a_dense_copy() -> None:
    layer = build(k=1, use_residual=True)
    x = torch.randn(2, 8, 16)
    out, _, _ = layer(x)
    assert out.shape == x.shape
    assert layer.mlp is not None and layer.coefficient.weight.shape == (2, 16)
    out.sum().backward()
    assert layer.coefficient.weight.grad is not None and layer.mlp[0].weight.grad is not None


@pytest.mark.parametrize("drop_tokens", [False, True])
@pytest.mark.parametrize(
    "act",
    [
        nn.GELU(),
        nn.GELU("tanh"),
        nn.ReLU(),
        nn.SiLU(inplace=True),
        nn.Tanh(),
        nn.Sigmoid(),
        nn.Identity(),
    ],
)
@pytest.mark.parametrize("bias", [True, False])
def test_fused_experts_equal_one_call_per_expert(
    drop_tokens: bool, act: nn.Module, bias: bool
) -> None:
    """The CPU's sliced kernel and ``torch._grouped_mm`` give the module calls' outputs and
    gradients, an expert with no token included."""
    layers = []
    for kernel in ("sliced", "grouped", "modules"):
        torch.manual_seed(0)
        expert = nn.Sequential(nn.Linear(16, 32, bias=bias), act, nn.Linear(32, 16, bias=bias))
        layer = zmoe.MoE(
            16, expert, num_experts=4, k=2, drop_tokens=drop_tokens, top2_2nd_expert_sampling=False
        )
        seed_experts(layer)
        assert layer.experts.fused
        layer.experts.grouped_on_cpu = kernel == "grouped"
        layer.experts.fused_on_cpu = kernel != "modules"
        with torch.no_grad():  # expert 3 gets no token
            layer.gate.wg.weight[3] = -10.0
        layers.append(layer)
    x = torch.randn(40, 16).abs()
    outs = []
    for layer in layers:
        xi = x.clone().requires_grad_()
        out, _, counts = layer(xi)
        assert counts[3] == 0
        out.sum().backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in layer.parameters()]
        outs.append((out, xi.grad, grads))
    if not hasattr(torch, "_grouped_mm") or not layers[1].experts.grouped:
        outs.pop(1)  # no grouped kernel in this torch (or it refused these inputs)
    for got in outs[:-1]:
        torch.testing.assert_close(got[0], outs[-1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], outs[-1][1], atol=1e-5, rtol=1e-5)
        for a, b in zip(got[2], outs[-1][2], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fused_experts_without_input_grad() -> None:
    layer = build(k=2, drop_tokens=False)
    out, _, _ = layer(torch.randn(12, 16))  # x needs no gradient; the experts do
    out.sum().backward()
    assert all(p.grad is not None for p in layer.experts.parameters())
    with torch.no_grad():
        assert layer(torch.randn(12, 16))[0].shape == (12, 16)


def test_all_to_all_on_one_process_copies() -> None:
    from zcore.comm.collectives import Comm

    inp, out = torch.arange(6.0).view(3, 2), torch.zeros(3, 2)
    Comm(None, 0, 1, 5.0).all_to_all_single(out, inp, None, None, "a2a").wait()
    assert torch.equal(out, inp)
