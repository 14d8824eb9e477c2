"""Full tensors from a tensor-parallel model: every ``tp`` shard gathered into one per name.

:func:`gather_full_state_dict` gives the state dict the model had before
:func:`~zcore.tensor.parallelize` cut it (same keys, full shapes), on every rank: each
cut parameter is all-gathered over ``tp`` and reassembled by its
:class:`~zcore.tensor.cut.TPCut` (fused blocks back in place); at ZeRO stage 3 the
parameters are first gathered over their data axes. Collective over the whole mesh.
"""

from __future__ import annotations

import torch
from torch import nn

from zcore.comm import Comm
from zcore.tensor.cut import cut_by_tp
from zcore.tensor.layers import TensorParallel
from zcore.zero import GatheredParameters


def tp_comm(model: nn.Module) -> Comm | None:
    """The ``tp`` comm of ``model``'s tensor-parallel layers (None: it has none)."""
    for m in model.modules():
        if isinstance(m, TensorParallel):
            return m.comm
    return None


def gather_full(p: torch.Tensor, comm: Comm | None, name: str) -> torch.Tensor:
    """``p``'s full value (a copy): its ``tp`` shards reassembled when it is cut."""
    cut = cut_by_tp(p)
    local = p.detach().clone()
    if cut is None or comm is None or comm.size == 1:
        return local
    out = local.new_empty((comm.size * local.shape[0], *local.shape[1:]))
    comm.all_gather(out, local.contiguous(), f"all_gather(tp shards of {name})").wait()
    return cut.unshard(list(out.chunk(comm.size, dim=0)))


@torch.no_grad()
def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of ``model`` at full size, by its name (tied
    parameters under each of their names), on every rank."""
    comm = tp_comm(model)
    out: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    with GatheredParameters(list(model.parameters())):
        for name, p in params.items():
            out[name] = gather_full(p, comm, name)
    for name, b in model.state_dict().items():
        if name not in out:
            out[name] = b.detach().clone()
    return out
