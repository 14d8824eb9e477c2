"""The weight-gradient pass of a zero-bubble schedule over activation-checkpointed layers.

A zero-bubble schedule (ZB-V) splits a stage's backward in two: ``I`` (gradients of the
stage's inputs, sent on at once) and, later, ``W`` (gradients of its weights).
``torch.distributed.pipelining`` runs ``W`` as one ``torch.autograd.grad`` per parameter
group (the weights meeting the input path at the same graph nodes: about one per layer
norm and linear). Each call is a graph task of its own, and a non-reentrant activation
checkpoint recomputes its layers once per graph task that reaches them: a checkpointed
transformer block was recomputed once for ``I`` and once more per parameter group in it
for ``W`` (six times for ``z train``'s block).

:class:`CheckpointedWeightStage` runs ``W`` of a checkpointed stage as one graph task over
every parameter group, so each checkpointed layer is recomputed once for it. The incoming
gradient of each group's graph node is pinned to the one saved during ``I`` (as torch pins
it within a group), so a gradient reaching that node again from a later node does not
count twice: every weight gets the same gradient, from the same operations, as torch's
per-group calls give it. That one task also runs the input-path nodes between the groups'
nodes again (their results are discarded by the pinning), so a stage without checkpoints
keeps torch's per-group calls, which are cheaper there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc


def weight_grads_at_once(weights: list[nn.Parameter], param_groups: list[dict[str, Any]]) -> None:
    """Add every parameter group's weight gradients into ``.grad`` with one
    ``torch.autograd.grad`` (``param_groups``: what torch's ``stage_backward_input`` kept,
    each with its ``intermediates`` nodes and their saved incoming ``grads``)."""
    weight_of = {_get_grad_fn_or_grad_acc(w): w for w in weights}
    edges: list[GradientEdge] = []
    outs: list[torch.Tensor] = []
    pinned: list[tuple[Any, tuple[Any, ...]]] = []
    leaves: dict[Any, None] = {}  # each weight's grad accumulator once, in order
    for group in param_groups:
        saved = group.pop("grads", None)
        nodes = group.pop("intermediates")
        if saved is None:  # the input pass never reached this group
            continue
        for grads, node in zip(saved, nodes, strict=True):
            pinned.append((node, grads))
            for i, g in enumerate(grads):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    outs.append(g)
        leaves.update(dict.fromkeys(group["params"]))
    if not edges:
        return
    handles = [node.register_prehook(lambda _, g=grads: g) for node, grads in pinned]
    try:
        accs = list(leaves)
        dws = torch.autograd.grad(edges, tuple(GradientEdge(a, 0) for a in accs), grad_outputs=outs)
    finally:
        for h in handles:
            h.remove()
    for acc, dw in zip(accs, dws, strict=True):
        w = weight_of[acc]
        if w.grad is None:
            w.grad = dw
        else:
            w.grad += dw


class CheckpointedWeightStage(PipelineStage):
    """A ``PipelineStage`` whose module checkpoints its layers: its ``W`` runs as one graph
    task (:func:`weight_grads_at_once`); everything else is torch's."""

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        if backward_type != "weight":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        weight_grads_at_once(list(self.submod.parameters()), bwd_kwargs["param_groups"])
        return (), None
