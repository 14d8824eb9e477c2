"""PPO's two trained models as ZeRO-3 engines, with DeepSpeed-Chat's LoRA options.

The actor is the SFT model loaded straight into ZeRO-3 partitions; the critic is the reward
model (:class:`~zchat.ppo.experience.Critic`). With ``*_lora_dim`` > 0 the matched linear
layers become :class:`zchat.lora.LoRALinear` before ``zcore.initialize`` (so the new LoRA
matrices are partitioned and broadcast like any parameter); the LoRA matrices form their own
param group at ``*_lora_learning_rate``. With ``only_optimize_lora`` the rest of a LoRA model
is frozen (``requires_grad`` off): the engine keeps no gradient and no Adam state for it,
and its backward computes only activation gradients through the frozen weights.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zchat.lora import convert_to_lora, only_optimize_lora_
from zchat.ppo.config import PPOConfig
from zchat.ppo.experience import Critic


def lora_param_groups(
    model: nn.Module,
    dim: int,
    module_name: str,
    key: str,
    only: bool,
    lora_lr: float,
    keep_trainable: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Convert ``model``'s matched linears to LoRA (``dim`` > 0) and return its param groups:
    the LoRA matrices at ``lora_lr``, then every other trainable parameter at the config's
    rate. ``only`` freezes all but the LoRA matrices and names ending in ``keep_trainable``."""
    if dim > 0:
        convert_to_lora(model, module_name, dim, key=key)
        if only:
            only_optimize_lora_(model)
            for name, p in model.named_parameters():
                if name.endswith(keep_trainable):
                    p.requires_grad_(True)
    lora, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            is_lora = name.endswith(("lora_right_weight", "lora_left_weight"))
            (lora if is_lora else rest).append(p)
    groups = [{"params": lora, "lr": lora_lr}] if lora else []
    return groups + ([{"params": rest}] if rest else [])


def build_actor(cfg: PPOConfig) -> Any:
    """The actor's ZeRO-3 engine (collective)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import zcore
    import zcore.hf

    ds = cfg.zero_config(cfg.actor_lr)
    hf_config = AutoConfig.from_pretrained(str(cfg.actor))
    actor = zcore.hf.from_pretrained(
        AutoModelForCausalLM, cfg.actor, ds_config=ds, config=hf_config
    )
    groups = lora_param_groups(
        actor,
        cfg.actor_lora_dim,
        cfg.actor_lora_module_name,
        "actor_lora_module_name",
        cfg.only_optimize_lora,
        cfg.actor_lora_learning_rate,
    )
    engine, *_ = zcore.initialize(actor, model_parameters=groups, config=ds)
    return engine


def build_critic(cfg: PPOConfig) -> Any:
    """The critic's ZeRO-3 engine, started from the reward model (collective)."""
    import zcore
    from zchat.reward import load_reward_model
    from zcore.zero import Init

    ds = cfg.zero_config(cfg.critic_lr)
    with Init(config=ds):  # the wrapper too, so the engine finds its partitions
        critic = Critic(load_reward_model(cfg.reward))
    groups = lora_param_groups(
        critic,
        cfg.critic_lora_dim,
        cfg.critic_lora_module_name,
        "critic_lora_module_name",
        cfg.only_optimize_lora,
        cfg.critic_lora_learning_rate,
        keep_trainable=("v_head.weight",),
    )
    engine, *_ = zcore.initialize(critic, model_parameters=groups, config=ds)
    return engine


def check_lora_name(dim: int, path: Any, names: str, key: str, causal_lm: bool = True) -> None:
    """Fail before any rank starts when ``names`` (the ``key`` option) matches no linear layer
    of the model at ``path`` (built on the meta device from ``config.json``: no weights read).
    ``causal_lm`` False: the bare backbone (a reward model's or critic's)."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    if dim > 0:
        cls = AutoModelForCausalLM if causal_lm else AutoModel
        with torch.device("meta"):
            skeleton = cls.from_config(AutoConfig.from_pretrained(str(path)))
        convert_to_lora(skeleton, names, dim, key=key)


def check_lora_names(cfg: PPOConfig) -> None:
    """:func:`check_lora_name` for the actor and the critic."""
    check_lora_name(
        cfg.actor_lora_dim, cfg.actor, cfg.actor_lora_module_name, "actor_lora_module_name"
    )
    check_lora_name(
        cfg.critic_lora_dim,
        cfg.reward,
        cfg.critic_lora_module_name,
        "critic_lora_module_name",
        causal_lm=False,
    )
