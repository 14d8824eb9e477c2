"""Per-phase wall time of one training step, for ``benchmarks/pipe.py``'s contenders.

A step splits into the same named phases on every side, so the JSON shows where one
side's step is longer than another's:

- ``schedule``: the pipeline schedule's ``step`` (every forward and backward of the step's
  micro-batches, with their sends); for DDP its forward/backward loop (its gradient
  all-reduce included, which DDP overlaps with the backward);
- ``grad_reduce``: gradients into what the optimizer steps (zcore: the tied layers' sum
  over ``pp`` and ``reduce_leftovers``, the ZeRO reduction into the fp32 partition; at dp 1
  lending and taking back the partition's zeroed views as ``.grad``, ``zcore.pipe.grad_views``);
- ``norm``: the global gradient norm (zcore; its scalar all-reduce over ``pp`` waits for
  the other stage, so this phase holds that wait);
- ``optimizer``: the optimizer's update (torch's ``AdamW.step``; zcore's inner step on the
  flat master);
- ``publish``: the master weights back into the parameters (zcore);
- ``zero_grad``: dropping the step's gradients;
- ``loss``: the step's mean loss as a Python float (zcore: its broadcast over ``pp``);
- ``other``: the rest of the time between the two barriers around a step.

Timing wraps bound methods on the contenders' own objects (instance attributes), so two
engines in one process are timed apart and nothing of zcore changes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

PHASES = ("schedule", "grad_reduce", "norm", "optimizer", "publish", "zero_grad", "loss")


class Phases:
    """Seconds spent in each phase since :meth:`reset` (nested phases count once, in the
    innermost)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._stack: list[list[float]] = []

    def reset(self) -> None:
        self.laps = dict.fromkeys(PHASES, 0.0)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its time (less that of the phases it calls) added to ``name``."""

        def run(*args: Any, **kwargs: Any) -> Any:
            self._stack.append([time.perf_counter(), 0.0])  # start, time of nested phases
            try:
                return fn(*args, **kwargs)
            finally:
                start, inner = self._stack.pop()
                spent = time.perf_counter() - start
                self.laps[name] += spent - inner
                if self._stack:
                    self._stack[-1][1] += spent

        return run

    def patch(self, obj: Any, attr: str, name: str) -> None:
        """Time ``obj.attr`` (a bound method) as phase ``name``, on this object only."""
        setattr(obj, attr, self.wrap(name, getattr(obj, attr)))

    def split(self, step_s: float) -> dict[str, float]:
        """This step's phases, with ``other`` the step's time none of them holds."""
        out = dict(self.laps)
        out["other"] = step_s - sum(out.values())
        return out


def time_engine(phases: Phases, engine: Any) -> None:
    """Time a ``zcore.pipe.PipelineEngine``'s phases."""
    zopt = engine.zopt
    phases.patch(engine, "_run", "schedule")
    phases.patch(engine.ties, "reduce_grads", "grad_reduce")
    phases.patch(zopt, "reduce_leftovers", "grad_reduce")
    phases.patch(engine.grad_views, "lend", "grad_reduce")
    phases.patch(engine.grad_views, "take_back", "grad_reduce")
    phases.patch(zopt, "global_grad_norm", "norm")
    phases.patch(zopt, "grads_overflow", "norm")
    phases.patch(zopt, "update", "optimizer")
    phases.patch(zopt, "publish", "publish")
    phases.patch(zopt, "zero_grad", "zero_grad")
    phases.patch(engine, "_mean_loss", "loss")


def median_per_rank(per_rank_steps: list[list[dict[str, float]]]) -> dict[str, list[float]]:
    """Per phase, each rank's median over the timed steps (seconds)."""
    names = [*PHASES, "other"]
    return {
        n: [statistics.median(step[n] for step in steps) for steps in per_rank_steps] for n in names
    }
