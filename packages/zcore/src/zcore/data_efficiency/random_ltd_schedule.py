"""Random-LTD's schedule: how many tokens the middle layers keep at each optimizer step,
and the layer-tokens a run has consumed (what the LayerToken learning rate follows).

DeepSpeed's semantics (``data_routing/scheduler.py``), steps counting from 0 (the engine's
``global_steps`` before the step):

- ``fixed_linear``: ``keep(s) = floor(s / require_steps * (max - min) + min)``, rounded
  *down* to a multiple of ``seq_per_step`` and capped at ``max_value``;
- a step consumes ``global_batch * (keep(s) * n_ltd + max_value * (L - n_ltd))``
  layer-tokens: the ``n_ltd`` random-LTD layers see ``keep(s)`` tokens of each sample and
  the other ``L - n_ltd`` layers ``max_value`` (the full sequence).

Both are closed-form in the step, so nothing needs a checkpoint: a resumed run recomputes
them from ``global_steps``.
"""

from __future__ import annotations

import math

from zcore.data_efficiency.random_ltd_config import RandomLTDConfig


class RandomLTDScheduler:
    """Kept tokens by step and layer-tokens consumed, from a checked random-LTD block."""

    def __init__(self, config: RandomLTDConfig, global_batch_size: int) -> None:
        s = config.random_ltd_schedule
        assert config.total_layer_num and config.random_ltd_layer_num
        assert s.min_value is not None and s.max_value is not None
        assert s.schedule_config.require_steps is not None
        if global_batch_size < 1:
            raise ValueError(f"random-LTD: global batch size {global_batch_size} must be >= 1")
        self.min_value, self.max_value = s.min_value, s.max_value
        self.require_steps = s.schedule_config.require_steps
        self.seq_per_step = s.schedule_config.seq_per_step
        self.total_layers = config.total_layer_num
        self.ltd_layers = config.random_ltd_layer_num
        self.global_batch_size = global_batch_size
        self.current = self.min_value
        """Tokens kept by the random-LTD layers in the current step."""
        self.step = -1
        """The step :meth:`update` was last called with."""
        self._done = 0  # steps whose layer-tokens are in _tokens
        self._tokens = 0

    def keep_at(self, step: int) -> int:
        """Tokens kept at optimizer step ``step`` (0-based); see the module docstring."""
        lo, hi = self.min_value, self.max_value
        value = math.floor(float(step) / self.require_steps * (hi - lo) + lo)
        value -= value % self.seq_per_step
        return min(value, hi)

    def layer_tokens_of(self, step: int) -> int:
        """Layer-tokens step ``step`` consumes."""
        full = self.total_layers - self.ltd_layers
        return self.global_batch_size * (
            self.keep_at(step) * self.ltd_layers + self.max_value * full
        )

    def layer_tokens_before(self, step: int) -> int:
        """Layer-tokens of steps ``0 .. step - 1`` (0 for step 0), summed incrementally."""
        if step < self._done:
            self._done, self._tokens = 0, 0
        while self._done < step:
            self._tokens += self.layer_tokens_of(self._done)
            self._done += 1
        return self._tokens

    def update(self, step: int) -> int:
        """Move to optimizer step ``step`` (the engine calls it before each training
        forward); returns the tokens kept there."""
        self.step = step
        self.current = self.keep_at(step)
        return self.current

    @property
    def consumed_layer_tokens(self) -> int:
        """Layer-tokens of every step up to and including the current one (DeepSpeed's
        ``consumed_layer_tokens``)."""
        return self.layer_tokens_before(self.step + 1)

    def state_dict(self) -> dict[str, int]:
        """DeepSpeed's scheduler state keys (informational: everything is recomputed from
        the step)."""
        return {
            "consumed_layer_tokens": self.consumed_layer_tokens,
            "current_steps": self.step,
            "current_value": self.current,
            "min_value": self.min_value,
            "max_value": self.max_value,
        }
