"""The ``scala`` config block: ScaLA's adversarial noise on the embedding output.

ScaLA (Zhang, Uma Naresh and He, "ScaLA: Accelerating Adaptation of Pre-Trained
Transformer-Based Language Models via Efficient Large-Batch Adversarial Noise", 2022) treats
large-batch fine-tuning as a sequential game: before each optimizer step a follower finds a
perturbation ``delta`` of the embedding output, inside a norm ball of radius ``epsilon``, that
raises the loss, by ``K`` steps of projected gradient ascent of size ``alpha`` from a start of
magnitude ``sigma``; the leader (the model) then steps on the loss at ``x + delta``. The keys
below name those symbols. DeepSpeed has no ScaLA, so these keys are zstack's own (named as
FreeLB-style code names them: ``adv_steps``, ``adv_step_size``, ``adv_max_norm``,
``adv_init_mag``).

Every value is checked when the block is read (``ZConfig.load``, or
:meth:`ScalaConfig.model_validate`), so a bad one fails before the first step, naming the key
and the fix; an unknown key is an error with a did-you-mean, like every zcore block.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from zcore.config._base import Bool, Float, Int, ZModel
from zcore.config.errors import problem_at

NormType = Literal["l2", "linf"]


class ScalaConfig(ZModel):
    """``scala``: adversarial perturbation of the embedding output (ScaLA); off by default."""

    enabled: Bool = False
    """Perturb the embedding output before each optimizer step; while false the other keys are
    checked but nothing runs (the step is the plain engine step)."""
    adv_steps: Int = Field(1, ge=0)
    """``K``: projected gradient-ascent steps on ``delta`` per micro-batch, each one extra
    forward and a backward to the embedding output only (no weight gradients). The paper's
    lightweight setting is 1. At least 1 when enabled."""
    adv_step_size: Float = Field(1e-1, ge=0)
    """``alpha``: the ascent step length. ``l2``: each sample's ``delta`` moves by ``alpha``
    along its normalized gradient; ``linf``: every element by ``alpha`` along its sign."""
    adv_max_norm: Float = Field(1.0, ge=0)
    """``epsilon``: the noise bound; after each ascent step ``delta`` is projected back into
    the ball of this radius (per sample, over its unmasked positions). 0 makes ``delta`` zero:
    the step is then the plain engine step (at the cost of the ascent passes)."""
    adv_init_mag: Float = Field(0.0, ge=0)
    """``sigma``: magnitude of the random start ``delta_0`` (``l2``: a uniformly random
    direction of this norm per sample; ``linf``: uniform in ``[-sigma, sigma]``); 0 starts at
    zero, so the first ascent step follows the clean loss's gradient. At most ``adv_max_norm``."""
    adv_norm: NormType = "l2"
    """The norm of the ball: ``l2`` (Frobenius norm over a sample's positions x hidden size) or
    ``linf`` (elementwise)."""
    adv_start_step: Int = Field(0, ge=0)
    """``t_0``: optimizer steps taken without noise before it starts (a delayed start lets the
    fresh task head settle first); 0 perturbs from the first step."""
    embedding: str | None = None
    """The module (``named_modules()`` name) whose output is perturbed; default: the model's
    ``get_input_embeddings()`` (the token embedding of any Hugging Face encoder or decoder)."""
    seed: Int = Field(0, ge=0)
    """Seed of the random start's own generator (offset by the rank), so the noise does not
    draw from the global stream that dropout uses."""

    @model_validator(mode="after")
    def _consistent(self) -> ScalaConfig:
        if not self.enabled:
            return self
        if self.adv_steps < 1:
            raise problem_at(
                "adv_steps",
                self.adv_steps,
                "ScaLA needs at least 1 ascent step when enabled; set adv_steps >= 1 (the paper "
                "uses 1) or enabled false",
            )
        if self.adv_max_norm > 0 and self.adv_step_size == 0:
            raise problem_at(
                "adv_step_size",
                0,
                "with adv_max_norm > 0 a zero step leaves delta at its start; set "
                "adv_step_size > 0 (e.g. adv_max_norm / adv_steps)",
            )
        if self.adv_init_mag > self.adv_max_norm:
            raise problem_at(
                "adv_init_mag",
                self.adv_init_mag,
                f"exceeds adv_max_norm {self.adv_max_norm}: the start would be clipped to the "
                f"bound; use adv_init_mag <= {self.adv_max_norm}",
            )
        return self
