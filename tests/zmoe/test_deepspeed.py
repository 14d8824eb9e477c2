"""zmoe.MoE against DeepSpeed's own MoE layer (``deepspeed.moe.layer.MoE``) on one process.

With the same gate, expert and residual weights, ``use_rts=False`` and
``top2_2nd_expert_sampling=False`` (both random in DeepSpeed), the outputs, ``l_aux`` and
``exp_counts`` match for the capacity path and the outputs for the dropless path, in fp32
with ``atol=rtol=1e-5`` (the experts' GEMMs run on differently shaped buffers, so only
rounding may differ). Needs DeepSpeed importable, e.g.
``PYTHONPATH=/root/.cache/zstack/deepspeed``; skipped otherwise. DeepSpeed's layer runs on
CPU without ``torch.distributed`` at ``ep_size=1``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import zmoe
from tests.zmoe.moe_utils import mlp

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ds_layer = pytest.importorskip("deepspeed.moe.layer")

ATOL = RTOL = 1e-5


def _pair(d: int, experts: int, **kwargs: object) -> tuple[torch.nn.Module, zmoe.MoE]:
    torch.manual_seed(0)
    ds = ds_layer.MoE(
        d,
        mlp(d, 2 * d),
        num_experts=experts,
        use_rts=False,
        top2_2nd_expert_sampling=False,
        **kwargs,
    )
    for expert in ds.deepspeed_moe.experts.deepspeed_experts:  # distinct experts
        for p in expert.parameters():
            p.data.normal_(0.0, 0.3)
    ours = zmoe.MoE(
        d,
        mlp(d, 2 * d),
        num_experts=experts,
        use_rts=False,
        top2_2nd_expert_sampling=False,
        **kwargs,
    )
    renamed = {
        name.replace("deepspeed_moe.gate.", "gate.").replace(
            "deepspeed_moe.experts.deepspeed_experts.", "experts."
        ): value
        for name, value in ds.state_dict().items()
    }
    ours.load_state_dict(renamed, strict=True)
    return ds, ours


@pytest.mark.parametrize(
    ("k", "drop_tokens", "use_residual"),
    [
        (1, True, False),
        (2, True, False),
        (3, True, False),
        (1, True, True),
        (1, False, False),
        (2, False, False),
        (3, False, False),
        (2, False, True),
    ],
)
def test_same_as_deepspeed(k: int, drop_tokens: bool, use_residual: bool) -> None:
    ds, ours = _pair(16, 4, k=k, drop_tokens=drop_tokens, use_residual=use_residual)
    x = torch.randn(3, 20, 16)
    x_ds, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ds, aux_ds, counts_ds = ds(x_ds)
    out, aux, counts = ours(x_ours)
    torch.testing.assert_close(out, out_ds, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(aux, aux_ds, atol=ATOL, rtol=RTOL)
    assert counts.tolist() == counts_ds.tolist()
    if drop_tokens and k == 1:
        assert ours.last_stats is not None and ours.last_stats.dropped_fraction > 0
    # and the same gradients, gate and input included
    w = torch.randn_like(out)
    ((out_ds * w).sum() + aux_ds).backward()
    ((out * w).sum() + aux).backward()
    torch.testing.assert_close(x_ours.grad, x_ds.grad, atol=ATOL, rtol=RTOL)
    gate_ds = ds.deepspeed_moe.gate.wg.weight.grad
    torch.testing.assert_close(ours.gate.wg.weight.grad, gate_ds, atol=ATOL, rtol=RTOL)
    expert_ds = ds.deepspeed_moe.experts.deepspeed_experts[1][0].weight.grad
    torch.testing.assert_close(ours.experts["1"][0].weight.grad, expert_ds, atol=ATOL, rtol=RTOL)
