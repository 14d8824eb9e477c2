"""``data_efficiency.data_routing.random_ltd``: DeepSpeed's random layer-token drop keys.

The keys and their names follow DeepSpeed's ``runtime/data_pipeline/constants.py``
(``total_layer_num``, ``random_ltd_layer_num``, ``random_ltd_layer_id``, ``model_mask_name``,
``model_type``, ``hidden_state_order``, ``random_ltd_schedule``, ``layer_token_lr_schedule``).
Where zstack is stricter than DeepSpeed it says so in the field's docstring; every check
runs at load, so a bad block fails before any rank builds a model:

- the dropped layers must be middle layers: ids in ``[1, total_layer_num - 2]`` (the first
  and the last layer see every token, as the random-LTD paper requires), distinct, and as
  many as ``random_ltd_layer_num`` (DeepSpeed reads both and trusts they agree);
- ``min_value <= max_value`` and ``seq_per_step`` divides ``min_value`` (every value is
  rounded down to a multiple of it, so the first steps would otherwise keep fewer tokens
  than ``min_value``);
- ``layer_token_lr_schedule`` is built here (DeepSpeed raises NotImplementedError): it needs
  ``total_layer_tokens`` and, when warming up, ``warmup_layer_tokens`` below it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from zcore.config._base import Bool, Int, ZModel, empty_block
from zcore.config.errors import MISSING, problem_at


class RandomLTDScheduleConfig(ZModel):
    """``random_ltd_schedule.schedule_config``: how fast the kept-token count grows."""

    require_steps: Int | None = Field(None, ge=1)
    """The step at which the kept tokens reach ``max_value``."""
    seq_per_step: Int = Field(16, ge=1)
    """Every kept-token count is rounded down to a multiple of this (16: tensor-core
    friendly, DeepSpeed's tutorial value)."""


class RandomLTDSchedule(ZModel):
    """``random_ltd_schedule``: tokens the middle layers keep, by optimizer step."""

    min_value: Int | None = Field(None, ge=1)
    """Tokens kept at step 0 (DeepSpeed's tutorial: 128 of 2048)."""
    max_value: Int | None = Field(None, ge=1)
    """Tokens kept once the schedule ends: the sequence length (then no token is dropped)."""
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    """How the count grows; DeepSpeed implements ``fixed_linear`` only."""
    schedule_config: RandomLTDScheduleConfig = Field(default_factory=empty_block)
    """The schedule's numbers."""


class LayerTokenLRConfig(ZModel):
    """``layer_token_lr_schedule``: the learning rate by layer-tokens consumed instead of
    by steps (zcore.lr_schedules.LayerTokenLR); it replaces the ``scheduler`` block's
    schedule, and the optimizer's ``lr`` is its peak."""

    enabled: Bool = False
    """Drive the learning rate by layer-tokens (DeepSpeed: not yet supported)."""
    total_layer_tokens: Int | None = Field(None, ge=1)
    """Layer-tokens at which the cosine decay reaches 0 (the run's total, usually)."""
    warmup_type: Literal["linear", "log"] = "linear"
    """The warm-up's shape, as WarmupLR's ``warmup_type``."""
    warmup_layer_tokens: Int = Field(0, ge=0)
    """Layer-tokens of the warm-up from 0 to the peak; 0: no warm-up."""


class RandomLTDConfig(ZModel):
    """``data_efficiency.data_routing.random_ltd``: random layer-token drop."""

    enabled: Bool = False
    """Middle layers see a random subset of tokens (the rest skip them)."""
    total_layer_num: Int | None = Field(None, ge=3)
    """Transformer layers of the model (checked against the model at start)."""
    random_ltd_layer_num: Int | None = Field(None, ge=1)
    """How many layers drop tokens."""
    random_ltd_layer_id: list[Int] | None = None
    """Which layers (0-based) drop tokens; never the first or the last."""
    model_mask_name: str | None = None
    """The layer's keyword argument holding the attention mask (``attention_mask`` for HF
    layers), gathered with the tokens; None: the layer takes no mask (z train's GPT)."""
    model_type: Literal["decoder", "encoder"] = "decoder"
    """``decoder``: causal attention (the kept tokens stay causal among themselves);
    ``encoder``: bidirectional (BERT)."""
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = "batch_seq_dim"
    """The layout of the hidden states a layer takes: (B, T, C) or (T, B, C)."""
    random_ltd_schedule: RandomLTDSchedule = Field(default_factory=empty_block)
    """Tokens kept by step."""
    layer_token_lr_schedule: LayerTokenLRConfig = Field(default_factory=empty_block)
    """The LayerToken learning-rate schedule."""

    @model_validator(mode="after")
    def _complete(self) -> RandomLTDConfig:
        if not self.enabled:
            return self
        for key in ("total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id"):
            if getattr(self, key) is None:
                raise problem_at(key, MISSING, "is required when random_ltd is enabled")
        total, num, ids = self.total_layer_num, self.random_ltd_layer_num, self.random_ltd_layer_id
        assert total is not None and num is not None and ids is not None
        bad = [i for i in ids if not 1 <= i <= total - 2]
        if bad:
            raise problem_at(
                "random_ltd_layer_id",
                ids,
                f"has {bad} outside [1, {total - 2}]: with total_layer_num {total} the first "
                f"(0) and last ({total - 1}) layers see every token; pick middle layers",
            )
        if len(set(ids)) != len(ids):
            raise problem_at("random_ltd_layer_id", ids, "names a layer twice")
        if len(ids) != num:
            raise problem_at(
                "random_ltd_layer_num",
                num,
                f"but random_ltd_layer_id names {len(ids)} layers {ids}; make them agree",
            )
        s = self.random_ltd_schedule
        where = "random_ltd_schedule"
        for key in ("min_value", "max_value"):
            if getattr(s, key) is None:
                raise problem_at(f"{where}.{key}", MISSING, "is required when random_ltd is on")
        if s.schedule_config.require_steps is None:
            raise problem_at(f"{where}.schedule_config.require_steps", MISSING, "is required")
        lo, hi, step = s.min_value, s.max_value, s.schedule_config.seq_per_step
        assert lo is not None and hi is not None
        if lo > hi:
            raise problem_at(
                f"{where}.min_value", lo, f"is above max_value {hi}; make min_value <= {hi}"
            )
        if lo % step:
            raise problem_at(
                f"{where}.min_value",
                lo,
                f"is not a multiple of schedule_config.seq_per_step {step}: every value is "
                f"rounded down to one, so the first steps would keep {lo - lo % step} tokens; "
                f"use {lo - lo % step + step} or a seq_per_step that divides it",
            )
        lr = self.layer_token_lr_schedule
        if lr.enabled:
            key = "layer_token_lr_schedule"
            if lr.total_layer_tokens is None:
                raise problem_at(f"{key}.total_layer_tokens", MISSING, "is required when enabled")
            if lr.warmup_layer_tokens >= lr.total_layer_tokens:
                raise problem_at(
                    f"{key}.warmup_layer_tokens",
                    lr.warmup_layer_tokens,
                    f"is not below total_layer_tokens {lr.total_layer_tokens}; the decay "
                    "needs layer-tokens after the warm-up",
                )
        return self
