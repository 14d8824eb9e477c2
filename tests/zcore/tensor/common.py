"""Tiny real setups for tensor-parallel tests: a small GPT, fixed data, one training loop.

The same function trains the plain model (``tp`` 1, no ``parallelize``: the baseline) and
the tensor-parallel one, so every comparison is against single-process training of the
model as ``z train`` builds it.
"""

from __future__ import annotations

from typing import Any

import torch

import zcore
from tests.zcore.zero.common import config
from zcore.comm import MeshSpec
from zcore.tensor import gather_full_state_dict, parallelize
from ztrain.gpt import GPT, GPTConfig

VOCAB, SEQ = 96, 16
GPT_SHAPE = dict(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, block_size=SEQ)
LOSS_RTOL = 1e-5
"""Relative tolerance of a step's loss against the baseline's (fp32; tp changes only the
order of sums)."""
PARAM_ATOL = 2e-5
"""Absolute tolerance of every parameter element after the run (AdamW, lr 3e-3)."""


def make_gpt(tie: bool = True) -> GPT:
    return GPT(GPTConfig(**GPT_SHAPE, tie_weights=tie), seed=0)


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    data = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def train(
    model: torch.nn.Module,
    spec: MeshSpec | None,
    stage: int,
    steps: int,
    mb: int,
    dp: int,
    sequence_parallel: bool = False,
) -> dict[str, Any]:
    """``steps`` optimizer steps of ``model`` (parallelized over ``spec``'s ``tp`` when it is
    above 1); each step's global batch is ``mb x dp`` sequences, this rank taking its data
    rank's ``mb``. Returns the losses (this rank's), gradient norms and full parameters."""
    if spec is not None and spec.tp > 1:
        model = parallelize(model, spec, sequence_parallel=sequence_parallel)
    cfg = config(stage, mb=mb, gas=1, clip=0.05)
    engine, *_ = zcore.initialize(model, config=cfg, mesh=spec)
    losses, norms = [], []
    for step in range(steps):
        x, y = global_batch(step, mb * dp)
        lo = engine.data_rank * mb
        _, loss = engine(x[lo : lo + mb], y[lo : lo + mb])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    params = gather_full_state_dict(engine.module)
    out = {"losses": losses, "norms": norms, "params": params, "data_rank": engine.data_rank}
    engine.destroy()
    return out


def assert_same_run(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0
    )
    torch.testing.assert_close(
        torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-4, atol=1e-7
    )
    assert got["params"].keys() == ref["params"].keys(), what
    for k, v in ref["params"].items():
        torch.testing.assert_close(got["params"][k], v, rtol=0, atol=PARAM_ATOL, msg=f"{what}: {k}")
