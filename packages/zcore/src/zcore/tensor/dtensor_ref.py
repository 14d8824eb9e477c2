"""The reference: the same GPT cut by torch's DTensor ``parallelize_module``.

Tests and ``z bench tp`` compare :mod:`zcore.tensor`'s layers with torch's own tensor
parallelism on the same model. :func:`dtensor_gpt` applies ``ColwiseParallel`` to
``c_attn`` and ``mlp.c_fc``, ``RowwiseParallel`` to ``attn.c_proj`` and ``mlp.c_proj``, a
vocabulary-parallel ``RowwiseParallel`` to the token embedding and a ``ColwiseParallel``
LM head whose logits are gathered (``Replicate``) for the GPT's own cross-entropy, or, with
``loss_parallel``, kept sharded for torch's vocabulary-parallel ``loss_parallel()``. The head
must be untied (DTensor plans do not tie a sharded embedding to a sharded head).

DTensor cuts ``c_attn``'s fused rows contiguously; the rows are first permuted from
``[q | k | v]`` to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` so that rank ``r`` holds the q, k
and v of the same heads (:func:`interleave_qkv`; :func:`deinterleave_qkv` undoes it).
The parameters are DTensors: ZeRO's flat buffers refuse them, so this model trains with a
plain torch optimizer (``foreach=False``: it mixes DTensors and tensors).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from zcore.tensor.gpt_plan import attention_forward
from zcore.tensor.plan import swap_forward


def interleave_qkv(w: torch.Tensor, tp: int) -> torch.Tensor:
    """Rows ``[q | k | v]`` (each cut into ``tp`` slices) as ``[q_0 k_0 v_0 | q_1 ...]``."""
    q, k, v = (t.chunk(tp, dim=0) for t in w.chunk(3, dim=0))
    return torch.cat([torch.cat([q[r], k[r], v[r]]) for r in range(tp)])


def deinterleave_qkv(w: torch.Tensor, tp: int) -> torch.Tensor:
    """The inverse of :func:`interleave_qkv`."""
    per_rank = [r.chunk(3, dim=0) for r in w.chunk(tp, dim=0)]
    return torch.cat([torch.cat([p[i] for p in per_rank]) for i in range(3)])


@torch.no_grad()
def dtensor_gpt(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = False) -> nn.Module:
    """``model`` (an untied ``ztrain`` GPT) cut over ``tp_mesh`` by ``parallelize_module``;
    ``loss_parallel``: the head's logits stay sharded over the vocabulary (a DTensor), and
    the forward and backward must run inside torch's ``loss_parallel()`` context."""
    if model.lm_head.weight is model.transformer.wte.weight:
        raise ValueError("dtensor_gpt needs an untied GPT (GPTConfig(tie_weights=False))")
    tp = tp_mesh.size()
    plan: dict[str, object] = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        if loss_parallel
        else ColwiseParallel(output_layouts=Replicate()),
    }
    for i, block in enumerate(model.transformer.h):
        at = block.attn
        at.c_attn.weight.copy_(interleave_qkv(at.c_attn.weight, tp))
        if at.c_attn.bias is not None:
            at.c_attn.bias.copy_(interleave_qkv(at.c_attn.bias, tp))
        at.n_head_local = at.n_head // tp
        swap_forward(at, attention_forward)
        name = f"transformer.h.{i}"
        plan[f"{name}.attn.c_attn"] = ColwiseParallel()
        plan[f"{name}.attn.c_proj"] = RowwiseParallel()
        plan[f"{name}.mlp.c_fc"] = ColwiseParallel()
        plan[f"{name}.mlp.c_proj"] = RowwiseParallel()
    return parallelize_module(model, tp_mesh, plan)


@torch.no_grad()
def dtensor_full_state(model: nn.Module, tp: int) -> dict[str, torch.Tensor]:
    """Every parameter of a :func:`dtensor_gpt` model at full size, ``c_attn`` rows back in
    ``[q | k | v]`` order (collective over the ``tp`` ranks)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if ".c_attn." in name:
            full = deinterleave_qkv(full, tp)
        out[name] = full.clone()
    return out
