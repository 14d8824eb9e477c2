"""PPO as DeepSpeed-Chat's step 3: actor and critic on ZeRO-3, a frozen reference and reward
model, rollouts on the hybrid engine (:mod:`zchat.hybrid`).

:mod:`zchat.ppo.losses` is the per-token math (KL-penalised rewards, GAE, clipped policy and
value losses), :mod:`zchat.ppo.experience` turns a rollout into those tensors,
:mod:`zchat.ppo.trainer` runs the loop, :class:`PPOConfig` holds every knob.
"""

from zchat.ppo.config import PPOConfig
from zchat.ppo.losses import gae, kl_penalized_rewards, policy_loss, value_loss

__all__ = ["PPOConfig", "gae", "kl_penalized_rewards", "policy_loss", "value_loss"]
