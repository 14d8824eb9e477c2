"""``PPOConfig``: every knob of ``z chat ppo``, validated at construction.

Defaults are DeepSpeed-Chat's step-3 ones where it has one: ``kl_coef`` 0.1 (its
``kl_ctl``), ``clip_reward`` 5 (``clip_reward_value``), ``cliprange`` 0.2, ``cliprange_value``
0.2, ``gamma`` 1.0, ``lam`` 0.95, ``actor_lr`` 9.65e-6, ``critic_lr`` 5e-6, ``ppo_epochs`` 1,
weight decay 0, the critic initialised from the reward model, the reference a frozen copy of
the SFT actor. Sizes are ours (CPU-sized): 8 prompts per rank per step (theirs 16 per GPU),
``max_new_tokens`` 16 (theirs 256).

LoRA keys are DeepSpeed-Chat's, with their defaults and meaning (:mod:`zchat.lora`):
``actor_lora_dim`` / ``critic_lora_dim`` 0 (off), ``actor_lora_module_name`` /
``critic_lora_module_name`` ``"decoder.layers."`` (OPT's layer names: LLaMA-family models
need ``"layers."``, and a name that matches no linear layer fails at start saying so),
``only_optimize_lora`` false, ``actor_lora_learning_rate`` / ``critic_lora_learning_rate``
5e-4 (the LoRA parameters' rate; the others keep ``actor_lr`` / ``critic_lr``). One
difference: with ``only_optimize_lora`` the critic's value head stays trainable too (576
numbers on SmolLM2), since PPO's value targets are not the reward model's scores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from zcore.config import ZModel  # the shared strict base (extra="forbid", frozen)


def check_ranges(cfg: ZModel, at_least: dict[str, float], positive: tuple[str, ...] = ()) -> None:
    """ValueError naming the key when ``cfg.<key>`` is below its bound or not > 0."""
    for key, low in at_least.items():
        if getattr(cfg, key) < low:
            raise ValueError(f"`{key}` must be >= {low:g}, got {getattr(cfg, key)}")
    for key in positive:
        if not getattr(cfg, key) > 0:
            raise ValueError(f"`{key}` must be > 0, got {getattr(cfg, key)}")


RECIPE: dict[str, Any] = {
    "steps": 20,
    "prompts_per_rank": 16,
    "max_new_tokens": 8,
    "train_prompts": 1024,
    "heldout_prompts": 128,
    "heldout_samples": 4,
    "whiten_advantages": True,
    "actor_lora_dim": 8,
    "critic_lora_dim": 8,
    "actor_lora_module_name": "layers.",
    "critic_lora_module_name": "layers.",
    "only_optimize_lora": True,
    "actor_lora_learning_rate": 2e-3,
    "critic_lora_learning_rate": 2e-3,
    "critic_lr": 1e-3,
}
"""What `z chat ppo` and `z chat e2e`'s PPO stage run with unless a config or flag says
otherwise: the recipe measured on SmolLM2-135M-Instruct with 2 CPU ranks on the arithmetic
task (``benchmarks/results/zchat-ppo.md`` has every run that chose it). LoRA only, rank 8 on
every linear layer of the decoder blocks (DeepSpeed-Chat's keys; ``"layers."`` names a
LLaMA-family model's blocks), both LoRAs at 4x DeepSpeed-Chat's rate (2e-3: LoRA's update is
scaled by 1/rank; at 5e-4 the policy barely left the reference in 20 steps, KL ~0.01 per
token, and the critic's loss was still falling at step 20), the critic's value head at 1e-3
(``critic_lr``: with ``only_optimize_lora`` it is the only non-LoRA tensor trained, and at
DeepSpeed-Chat's 5e-6 it did not move), 8 new tokens per rollout (the answers are a few
tokens), 20 steps of 16 prompts per rank, advantages whitened, 4 fixed-seed sampled answers
per held-out prompt, and the 1024 / 128 prompt split of the e2e's stages. The class defaults
stay DeepSpeed-Chat's."""


class PPOConfig(ZModel):
    """What ``z chat ppo`` trains, on what, and how. Unknown keys are refused (a typo such
    as ``kl_cof`` fails instead of keeping the default)."""

    actor: Path
    """The SFT model directory: the actor starts from it and the reference is a frozen copy."""
    reward: Path
    """The reward model directory (`z chat reward`); the critic starts from it too."""
    out: Path
    """Where the trained actor and ``metrics.jsonl`` go."""
    task: Literal["arithmetic"] = "arithmetic"
    """zchat.data task whose ``prompts_train`` are rolled out and ``prompts_heldout`` scored
    (Shakespeare needs zstack's plays handed in; not wired for PPO yet)."""
    data_seed: int = 0
    train_prompts: int = 256
    heldout_prompts: int = 64
    steps: int = 20
    """PPO steps (one rollout + ``ppo_epochs`` updates each)."""
    prompts_per_rank: int = 8
    """Prompts each rank rolls out per step (DeepSpeed-Chat's per-device generation batch)."""
    max_new_tokens: int = 16
    temperature: float = 1.0
    """Sampling temperature of the rollouts (held-out scoring is greedy)."""
    kl_coef: float = 0.1
    """Weight of the per-token KL(actor || reference) penalty in the reward (DeepSpeed-Chat's
    ``kl_ctl``); 0 turns it off."""
    clip_reward: float = 5.0
    """The reward model's score is clipped to [-clip_reward, clip_reward]."""
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    actor_lr: float = 9.65e-6
    critic_lr: float = 5e-6
    ppo_epochs: int = 1
    whiten_advantages: bool = False
    """Shift and scale each rank's advantages to mean 0, variance 1 over its response tokens
    before the policy loss (TRL's and OpenRLHF's practice; DeepSpeed-Chat does not). With a
    critic started from the reward model, whose values before the last token are not yet
    returns, the raw advantages were mostly of one sign (mean ~+1.5) and pushed up every
    sampled token alike."""
    critic_warmup_steps: int = 0
    """The first this many steps train the critic alone (the actor is frozen: its rollouts
    still feed the critic); OpenRLHF's ``freezing_actor_steps``. A critic started from the
    reward model has not yet learned values before the last token, and the advantages of
    the first steps are mostly its error."""
    gradient_clipping: float = 1.0
    actor_lora_dim: int = 0
    """LoRA rank of the actor's matched linear layers (0: no LoRA)."""
    actor_lora_module_name: str = "decoder.layers."
    """Comma-separated name parts: a linear layer whose name contains one gets LoRA."""
    critic_lora_dim: int = 0
    critic_lora_module_name: str = "decoder.layers."
    only_optimize_lora: bool = False
    """In each model with LoRA, train only the LoRA matrices (and the critic's value head);
    the rest is frozen and has no gradients and no optimizer state."""
    actor_lora_learning_rate: float = 5e-4
    critic_lora_learning_rate: float = 5e-4
    seed: int = 0
    """Seed of the rollouts' sampling (each rank and step draws its own stream from it)."""
    world: int = 2
    """Ranks (processes, gloo on CPU)."""
    threads: int = 1
    """torch threads per rank."""
    eval_every: int = 0
    """Score the held-out prompts every this many steps too (0: only before and after)."""
    heldout_samples: int = 0
    """Also sample this many answers per held-out prompt at ``temperature`` (what PPO
    optimises: the expected reward of the sampling policy) and report their mean reward and
    accuracy (``heldout_sampled_*``); their seeds are fixed, so every evaluation of every
    run draws the same random numbers. 0: greedy answers only."""

    def model_post_init(self, context: Any, /) -> None:
        check_ranges(
            self,
            {
                "train_prompts": 1,
                "heldout_prompts": 1,
                "steps": 1,
                "prompts_per_rank": 1,
                "max_new_tokens": 1,
                "gamma": 0,
                "lam": 0,
                "ppo_epochs": 1,
                "world": 1,
                "threads": 1,
                "eval_every": 0,
                "heldout_samples": 0,
                "actor_lora_dim": 0,
                "critic_lora_dim": 0,
                "critic_warmup_steps": 0,
            },
            (
                "temperature",
                "clip_reward",
                "cliprange",
                "cliprange_value",
                "actor_lr",
                "critic_lr",
                "gradient_clipping",
                "actor_lora_learning_rate",
                "critic_lora_learning_rate",
            ),
        )
        if self.kl_coef < 0:
            raise ValueError(
                f"`kl_coef` {self.kl_coef} < 0 would reward moving away from the reference "
                "model; use a value >= 0 (DeepSpeed-Chat's kl_ctl is 0.1; 0 turns it off)"
            )
        if self.cliprange >= 1 or self.gamma > 1 or self.lam > 1:
            raise ValueError(
                f"`cliprange` {self.cliprange} must be < 1, `gamma` {self.gamma} and `lam` "
                f"{self.lam} <= 1"
            )
        if self.critic_warmup_steps >= self.steps:
            raise ValueError(
                f"`critic_warmup_steps` {self.critic_warmup_steps} >= `steps` {self.steps}: the "
                "actor would never train; lower it or raise `steps`"
            )
        if self.only_optimize_lora and not (self.actor_lora_dim or self.critic_lora_dim):
            raise ValueError(
                "`only_optimize_lora` needs LoRA: set `actor_lora_dim` and/or `critic_lora_dim`"
                " > 0 (a model without LoRA trains whole), or turn `only_optimize_lora` off"
            )
        for key in ("actor", "reward"):
            path = getattr(self, key)
            if not (path / "config.json").is_file():
                what = "the SFT output of `z chat sft`" if key == "actor" else "`z chat reward`'s"
                raise ValueError(
                    f"`{key}` `{path}` is not a model directory (no config.json); pass {what}"
                    + (" output" if key == "reward" else "")
                )

    def zero_config(self, lr: float) -> dict:
        """The ZeRO-3 config of the actor or the critic (AdamW, betas as DeepSpeed-Chat's;
        a param group's own ``lr`` wins for its parameters)."""
        return {
            "train_micro_batch_size_per_gpu": self.prompts_per_rank,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.gradient_clipping,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.0},
            },
            # a parameter is re-gathered for the backward instead of kept from the forward:
            # with two trained models and a frozen one on each rank the kept copies were the
            # largest part of the training phase's peak
            "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0},
            "comm_timeout_s": 600,
        }
