"""``PPOConfig``: every knob of ``z chat ppo``, validated at construction.

Defaults are DeepSpeed-Chat's step-3 ones where it has one: ``kl_coef`` 0.1 (its
``kl_ctl``), ``clip_reward`` 5 (``clip_reward_value``), ``cliprange`` 0.2, ``cliprange_value``
0.2, ``gamma`` 1.0, ``lam`` 0.95, ``actor_lr`` 9.65e-6, ``critic_lr`` 5e-6, ``ppo_epochs`` 1,
weight decay 0, the critic initialised from the reward model, the reference a frozen copy of
the SFT actor. Sizes are ours (CPU-sized): 8 prompts per rank per step (theirs 16 per GPU),
``max_new_tokens`` 16 (theirs 256).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class PPOConfig(BaseModel):
    """What ``z chat ppo`` trains, on what, and how. Unknown keys are refused (a typo such
    as ``kl_cof`` fails instead of keeping the default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    actor: Path
    """The SFT model directory: the actor starts from it and the reference is a frozen copy."""
    reward: Path
    """The reward model directory (`z chat reward`); the critic starts from it too."""
    out: Path
    """Where the trained actor and ``metrics.jsonl`` go."""
    task: Literal["arithmetic", "shakespeare"] = "arithmetic"
    """zchat.data task whose ``prompts_train`` are rolled out and ``prompts_heldout`` scored."""
    data_seed: int = 0
    train_prompts: int = Field(default=256, ge=1)
    heldout_prompts: int = Field(default=64, ge=1)
    steps: int = Field(default=20, ge=1)
    """PPO steps (one rollout + ``ppo_epochs`` updates each)."""
    prompts_per_rank: int = Field(default=8, ge=1)
    """Prompts each rank rolls out per step (DeepSpeed-Chat's per-device generation batch)."""
    max_new_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature of the rollouts (held-out scoring is greedy)."""
    kl_coef: float = 0.1
    """Weight of the per-token KL(actor || reference) penalty in the reward (DeepSpeed-Chat's
    ``kl_ctl``); 0 turns it off."""
    clip_reward: float = Field(default=5.0, gt=0.0)
    """The reward model's score is clipped to [-clip_reward, clip_reward]."""
    cliprange: float = Field(default=0.2, gt=0.0, lt=1.0)
    cliprange_value: float = Field(default=0.2, gt=0.0)
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    lam: float = Field(default=0.95, ge=0.0, le=1.0)
    actor_lr: float = Field(default=9.65e-6, gt=0.0)
    critic_lr: float = Field(default=5e-6, gt=0.0)
    ppo_epochs: int = Field(default=1, ge=1)
    gradient_clipping: float = Field(default=1.0, gt=0.0)
    seed: int = 0
    """Seed of the rollouts' sampling (each rank and step draws its own stream from it)."""
    world: int = Field(default=2, ge=1)
    """Ranks (processes, gloo on CPU)."""
    threads: int = Field(default=1, ge=1)
    """torch threads per rank."""
    eval_every: int = Field(default=0, ge=0)
    """Score the held-out prompts every this many steps too (0: only before and after)."""

    @field_validator("kl_coef")
    @classmethod
    def _kl_nonnegative(cls, v: float) -> float:
        if v < 0:
            raise ValueError(
                f"kl_coef {v} < 0 would reward moving away from the reference model; use a "
                "value >= 0 (DeepSpeed-Chat's kl_ctl is 0.1; 0 turns the penalty off)"
            )
        return v

    @model_validator(mode="after")
    def _dirs(self) -> PPOConfig:
        for key in ("actor", "reward"):
            path = getattr(self, key)
            if not (path / "config.json").is_file():
                raise ValueError(
                    f"{key} `{path}` is not a model directory (no config.json); pass the "
                    f"{'SFT output of `z chat sft`' if key == 'actor' else 'output of `z chat reward`'}"
                )
        return self

    def zero_config(self, lr: float) -> dict:
        """The ZeRO-3 config of the actor or the critic (AdamW, betas as DeepSpeed-Chat's)."""
        return {
            "train_micro_batch_size_per_gpu": self.prompts_per_rank,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.gradient_clipping,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.0},
            },
            "zero_optimization": {"stage": 3},
            "comm_timeout_s": 600,
        }
