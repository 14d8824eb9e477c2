"""``z chat e2e``: DeepSpeed-Chat's three steps in one run, SFT -> reward model -> PPO, each
stage's output directory the next one's input.

:class:`E2EConfig` is one JSON file (or flags): the base chat model, the output root, the
ranks, the task, and one block of keys per stage (``sft``, ``reward``, ``ppo``: any key of
:class:`~zchat.sft.SFTConfig`, :class:`~zchat.reward_train.RewardConfig`,
:class:`~zchat.ppo.PPOConfig` except the wiring ones, which the e2e sets). Every stage's
config is built and checked at start, before the first rank runs, so a typo in the PPO
block fails in a second, not after the SFT hour. Layout under ``out``: ``sft/`` (the SFT
model), ``reward/`` (the reward model), ``ppo/`` (the PPO actor and ``metrics.jsonl``);
SFT's and the reward stage's metrics sit beside their directories as ``*.metrics.jsonl``.

The defaults below (:data:`STAGE_DEFAULTS`) are the sizes measured on SmolLM2-135M-Instruct
with 2 CPU ranks on the arithmetic task; the PPO stage's are :data:`zchat.ppo.config.RECIPE`
(LoRA only, 20 steps of 16 prompts per rank, whitened advantages; see
``benchmarks/results/zchat-ppo.md`` for what it measured).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from zchat.ppo.config import RECIPE as PPO_RECIPE
from zcore.config import ZModel

STAGE_DEFAULTS: dict[str, dict[str, Any]] = {
    "sft": {"steps": 12, "micro_batch": 4, "train_examples": 1024, "heldout_examples": 128},
    "reward": {
        "score_at": "before_eos",
        "warmup_blocks": 4,
        "warmup_epochs": 3,
        "warmup_batch": 16,
        "steps": 0,
        "train_examples": 1024,
        "heldout_examples": 128,
    },
    "ppo": PPO_RECIPE,
}
"""What each stage runs with unless the config's block says otherwise."""

WIRED: dict[str, tuple[str, ...]] = {
    "sft": ("model", "out", "task", "data_seed"),
    "reward": ("model", "out", "task", "data_seed"),
    "ppo": ("actor", "reward", "out", "task", "data_seed", "world"),
}
"""Keys the e2e sets itself (the stage chain and the shared task); a block may not set them."""


class E2EConfig(ZModel):
    """What ``z chat e2e`` runs. Unknown keys are refused."""

    model: Path
    """The base chat model directory (SFT starts from it)."""
    out: Path = Path("runs/chat/e2e")
    """Root of the three stages' outputs."""
    world: int = 2
    """Ranks of every stage (gloo on CPU)."""
    task: Literal["arithmetic"] = "arithmetic"
    """The zchat.data task of every stage (PPO grades arithmetic only)."""
    data_seed: int = 0
    """Which examples are built: the same train / held-out split in every stage."""
    # pydantic copies a mutable default per instance
    sft: dict[str, Any] = {}  # noqa: RUF012
    """Keys of the SFT stage's config (``zchat.sft.SFTConfig``)."""
    reward: dict[str, Any] = {}  # noqa: RUF012
    """Keys of the reward stage's config (``zchat.reward_train.RewardConfig``)."""
    ppo: dict[str, Any] = {}  # noqa: RUF012
    """Keys of the PPO stage's config (``zchat.ppo.PPOConfig``)."""

    def model_post_init(self, context: Any, /) -> None:
        if self.world < 1:
            raise ValueError(f"`world` must be >= 1, got {self.world}")
        if not (self.model / "config.json").is_file():
            raise ValueError(
                f"`model` `{self.model}` is not a model directory (no config.json); pass a "
                "Hugging Face chat model (`make models` fetches SmolLM2-135M-Instruct)"
            )
        for stage, keys in WIRED.items():
            taken = sorted(set(getattr(self, stage)) & set(keys))
            if taken:
                raise ValueError(
                    f"`{stage}.{taken[0]}` is set by the e2e chain (each stage reads the one "
                    f"before); remove it from the `{stage}` block (top-level keys: model, out, "
                    "world, task, data_seed)"
                )

    def stage_dict(self, stage: str) -> dict[str, Any]:
        """The keys of ``stage``'s config: its defaults, the block, then the wiring."""
        out = self.out
        wiring: dict[str, Any] = {
            "task": self.task,
            "data_seed": self.data_seed,
            "out": str(out / stage),
        }
        if stage == "sft":
            wiring["model"] = str(self.model)
        elif stage == "reward":
            wiring["model"] = str(out / "sft")
        else:
            wiring |= {
                "actor": str(out / "sft"),
                "reward": str(out / "reward"),
                "world": self.world,
            }
        return STAGE_DEFAULTS[stage] | getattr(self, stage) | wiring

    def check_stages(self) -> None:
        """Build each stage's config now (the later stages' inputs do not exist yet: they are
        checked against the base model's directory), raising ChatConfigError naming the
        stage and key."""
        from zchat.config import ChatConfigError, load_config
        from zchat.ppo import PPOConfig
        from zchat.reward_train import RewardConfig
        from zchat.sft import SFTConfig

        classes = {"sft": SFTConfig, "reward": RewardConfig, "ppo": PPOConfig}
        for stage, cls in classes.items():
            data = self.stage_dict(stage)
            for key in ("model", "actor", "reward"):
                if key in data and stage != "sft":
                    data[key] = str(self.model)
            try:
                load_config(cls, data)
            except ChatConfigError as err:
                raise ChatConfigError(f"e2e block `{stage}`: {err}") from None
