"""zcore's tensor-parallel GPT against torch's DTensor ``parallelize_module`` on the same GPT.

Two ranks train the same untied GPT for 10 AdamW steps twice: cut by
:func:`zcore.tensor.parallelize` and by DTensor's ``ColwiseParallel``/``RowwiseParallel``
(:mod:`zcore.tensor.dtensor_ref`), both with a plain ``torch.optim.AdamW`` (DTensor
parameters cannot go into ZeRO). Losses must agree to 1e-5 relative and every gathered
parameter to 2e-5 absolute.
"""

from __future__ import annotations

import torch

from tests.utils.distributed import run_ranks
from tests.zcore.tensor.common import PARAM_ATOL, global_batch, make_gpt
from zcore.comm import MeshSpec, job_mesh
from zcore.tensor import gather_full_state_dict, parallelize
from zcore.tensor.dtensor_ref import dtensor_full_state, dtensor_gpt

STEPS, MB = 10, 2


def _train(model: torch.nn.Module) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, MB)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _run(rank: int, world: int) -> dict:
    spec = MeshSpec.resolve(world, tp=world)
    mesh = job_mesh(spec, 60.0)
    ours = parallelize(make_gpt(tie=False), mesh)
    ours_losses = _train(ours)
    ref = dtensor_gpt(make_gpt(tie=False), mesh.device_mesh["tp"])
    ref_losses = _train(ref)
    return {
        "ours": (ours_losses, gather_full_state_dict(ours)),
        "dtensor": (ref_losses, dtensor_full_state(ref, world)),
    }


def test_tp2_gpt_matches_dtensor_parallelize_module() -> None:
    for out in run_ranks(_run, 2):
        (mine, params), (ref, ref_params) = out["ours"], out["dtensor"]
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(ref), rtol=1e-5, atol=0)
        assert params.keys() == ref_params.keys()
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=0, atol=PARAM_ATOL, msg=k)
