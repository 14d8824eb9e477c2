"""zchat: RLHF a la DeepSpeed-Chat on zcore's ZeRO-3 and zserve's paged-KV runner.

Stages, each from a config and each its own `z chat` command: supervised fine-tuning on a
chat model's own template with the loss on answers only, a reward model (the LM with a
scalar head, pairwise loss), PPO with the hybrid engine (the ZeRO-3 actor gathered into
zserve's runner for rollouts), DPO and GRPO.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
