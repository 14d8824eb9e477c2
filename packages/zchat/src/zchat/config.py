"""Stage configs: one pydantic model per stage (zcore's ``ZModel``: unknown keys rejected,
values checked at construction, immutable), loaded with messages that name the key.

Defaults follow DeepSpeed-Chat's training scripts where they have one (``seed`` 1234,
``weight_decay`` 0, a cosine schedule without warmup, ``max_len`` 512, gradient clipping
1.0, ZeRO stage 3 with ``stage3_param_persistence_threshold`` 1e4, DPO's ``beta`` 0.1 and
``label_smoothing`` 0); learning rates and sizes are zchat's, chosen so a stage on
SmolLM2-135M learns in tens of steps on CPU (each stage's docstring says which).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, TypeVar

from zcore.config import ZModel  # the shared strict base (extra="forbid", frozen)

C = TypeVar("C", bound=ZModel)


class ChatConfigError(ValueError):
    """A stage config with an unknown key or a bad value; the message names each."""


class StageConfig(ZModel):
    """What every training stage shares: the model, the data, the optimizer and ZeRO."""

    model: str
    """The model directory to start from (Hugging Face format, with a chat template)."""
    out: str
    """Where the trained model directory is written (replaced atomically)."""
    task: Literal["arithmetic", "shakespeare"] = "arithmetic"
    """Which dataset (``zchat.data.TASKS``)."""
    train_examples: int = 512
    """Examples (prompts, pairs) built for training."""
    heldout_examples: int = 64
    """Examples built for the held-out metric."""
    data_seed: int = 0
    """Which examples are built (the held-out set stays fixed while ``seed`` varies)."""
    seed: int = 1234
    """Batch order and head init: what differs between runs (DeepSpeed-Chat's default)."""
    steps: int = 30
    """Optimizer steps."""
    micro_batch: int = 4
    """Examples (or pairs) per rank per micro-step."""
    grad_accum: int = 1
    """Micro-steps per optimizer step."""
    lr: float = 1e-5
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning-rate schedule after warmup."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    max_len: int = 512
    """Longest rendered example in tokens (prompts are cut from the left, answers kept)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0: none)."""
    zero_stage: int = 3
    """ZeRO stage of the trained model."""
    persistence_threshold: int = 10_000
    """Parameters with at most this many elements stay whole at stage 3."""
    eval_batch: int = 16
    """Examples per rank per held-out forward."""
    log_every: int = 1
    """Steps between progress lines and metric records."""

    def zero_steps_allowed(self) -> bool:
        """Whether ``steps`` may be 0 (a stage whose training happens before its steps)."""
        return False

    def model_post_init(self, context: Any, /) -> None:
        positive = ("steps", "micro_batch", "grad_accum", "eval_batch", "log_every", "max_len")
        for key in positive:
            if getattr(self, key) < 1 and not (
                key == "steps" and self.steps == 0 and self.zero_steps_allowed()
            ):
                raise ValueError(f"`{key}` must be ≥ 1, got {getattr(self, key)}")
        for key in ("train_examples", "heldout_examples", "warmup_steps", "persistence_threshold"):
            if getattr(self, key) < 0:
                raise ValueError(f"`{key}` must be ≥ 0, got {getattr(self, key)}")
        if not self.lr > 0:
            raise ValueError(f"`lr` must be > 0, got {self.lr}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("`weight_decay` and `grad_clip` must be ≥ 0")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"`zero_stage` must be 0-3, got {self.zero_stage}")


def load_config(
    cls: type[C], data: dict[str, Any] | str | os.PathLike[str] | None = None, **overrides: Any
) -> C:
    """``cls`` from a dict or a JSON file, with ``overrides`` (None values skipped) on top.

    Raises :class:`ChatConfigError` naming every unknown key (with the accepted ones) and
    every bad value."""
    where = "the config"
    if isinstance(data, str | os.PathLike):
        where = f"`{data}`"
        try:
            data = json.loads(Path(data).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ChatConfigError(f"cannot read {where}: {err}") from None
    merged = dict(data or {})
    merged.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**merged)
    except ValueError as err:
        problems = getattr(err, "errors", None)
        if problems is None:
            raise ChatConfigError(f"{cls.__name__} in {where}: {err}") from None
        lines = []
        for p in problems():
            key = ".".join(str(x) for x in p["loc"]) or "(config)"
            if p["type"] == "extra_forbidden":
                accepted = ", ".join(sorted(cls.model_fields))
                lines.append(f"unknown key `{key}` (accepted: {accepted}); remove or rename it")
            elif p["type"] == "missing":
                lines.append(f"`{key}` is required")
            elif not p["loc"]:  # a check across keys (model_post_init) names its own key
                lines.append(str(p["msg"]).removeprefix("Value error, "))
            else:
                lines.append(f"`{key}`: {p['msg']}")
        raise ChatConfigError(f"{cls.__name__} in {where}: " + "; ".join(lines)) from None
