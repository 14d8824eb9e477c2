"""ZeRO stage 3 under a pipeline: a stage's parameters gathered once per step.

A pipeline schedule runs each stage's layers forward and backward once per micro-batch, so
the ordinary stage-3 hooks (:class:`~zcore.zero.stage3.Stage3Params`: gather around each
module's forward, again around its backward, release after) would all-gather every
parameter ``2 x gradient_accumulation_steps`` times per step. Under a
:class:`~zcore.pipe.engine.PipelineEngine` those hooks are taken off and
:class:`HeldParameters` owns the gathers instead:

- before the schedule runs, every partitioned parameter the rank's stages hold is
  all-gathered over its ZeRO axis, once (in buckets of ``stage3_prefetch_bucket_size``
  elements, each completed before the next is issued, so the gather's transient memory is
  one bucket);
- every micro-batch's forward and backward (activation checkpointing's recomputation too)
  reads those full values, and the gradients accumulate in ``p.grad`` at full size;
- at the accumulation boundary the engine reduce-scatters each accumulated gradient once
  (the same ``reduce_leftovers`` as stages 0-2), then the full values are released before
  the optimizer steps the shards.

The memory trade: a stage's full parameters and their full-size gradients live for the
whole step (as the pipeline's ZeRO-2 holds them), the price of one gather per step
instead of ``2 x gradient_accumulation_steps``; between steps each rank holds only its ``1/dp`` shard of the
cut parameters, as well as of the master weights and optimizer state (as at stages 1-2),
so the optimizer step, checkpoints and an idle engine run without the full copy. The
traffic equals ZeRO-2's under a pipeline: stage 3 all-gathers the cut parameters before
the schedule where ZeRO-2 all-gathers every updated parameter after the step (only the
persistent ones are gathered after a stage-3 step). Parameters of at most
``stage3_param_persistence_threshold`` elements stay gathered always, as without a
pipeline. Evaluation (``eval_batch``) gathers and releases the same way. An explicit
``stage3_max_live_parameters`` below a stage's cut parameters is refused at start (they
are all live during the step); unset, it does not bound the hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from zcore.comm import Comm
from zcore.zero.stage3 import Stage3Params


class HeldParameters:
    """The partitioned parameters of one pipeline rank's stages, gathered per step."""

    def __init__(self, stage3: Stage3Params, module: nn.Module) -> None:
        self.stage3 = stage3
        stage3.remove_hooks()  # this class gathers: no per-module gathers or releases
        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        for p in module.parameters():
            if id(p) not in seen and p in stage3.params and not stage3.params[p].persistent:
                seen.add(id(p))
                self.params.append(p)
        self.bucket_elems = max(1, stage3.prefetch_elems)
        self.held = False

    @property
    def elems(self) -> int:
        """Elements of the cut parameters this rank gathers for a step."""
        return sum(self.stage3.params[p].numel for p in self.params)

    def check_limit(self, pp: Comm, limit: int, device: torch.device) -> None:
        """Refuse, on every pipeline rank, a stage holding more gathered elements than an
        explicit ``stage3_max_live_parameters``: held for the whole step, they would all be
        live at once (collective over ``pp``; the message names the largest stage)."""
        most = torch.tensor([self.elems], dtype=torch.int64, device=device)
        what = "all_reduce(stage-3 parameters held for the step, max)"
        pp.all_reduce(most, what, dist.ReduceOp.MAX).wait()
        if int(most.item()) > limit:
            raise ValueError(
                f"zero_optimization.stage3_max_live_parameters is {limit}, but under a "
                f"pipeline stage 3 keeps a stage's cut parameters gathered for the whole step "
                f"and a pipeline rank holds {int(most.item())} elements of them; raise "
                f"stage3_max_live_parameters to at least {int(most.item())} (or leave it "
                "unset), cut the model into more pipeline stages, or use ZeRO stage 2"
            )

    def buckets(self) -> list[list[nn.Parameter]]:
        """The parameters in gather order, cut into buckets of at most ``bucket_elems``
        gathered elements (a larger parameter is a bucket of its own)."""
        out: list[list[nn.Parameter]] = []
        size = 0
        for p in self.params:
            numel = self.stage3.params[p].numel
            if not out or size + numel > self.bucket_elems:
                out.append([])
                size = 0
            out[-1].append(p)
            size += numel
        return out

    def gather(self) -> None:
        """All-gather every held parameter once (blocking)."""
        if self.held:
            return
        self.held = True
        for i, bucket in enumerate(self.buckets()):
            self.stage3.gather(bucket, f"pipeline stage parameters, bucket {i}")

    def release(self) -> None:
        """Drop the full values; each rank keeps its shard."""
        self.stage3.release(self.params)
        self.held = False

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """The stage's full parameters inside the block, released on leaving it (also when
        the block raises, so a failed step leaves no full copy behind)."""
        self.gather()
        try:
            yield
        finally:
            self.release()
