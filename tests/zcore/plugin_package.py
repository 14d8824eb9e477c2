"""`zplug`, a package outside zcore written at test time: an optimizer type and a config block,
declared through entry points in its own `dist-info`, so zcore finds them exactly as it finds
an installed package's (importlib.metadata reading the folder on `sys.path`)."""

from __future__ import annotations

from pathlib import Path

ZPLUG = '''
"""A plug-in: plain SGD (p -= lr * grad) as optimizer type `PlainSGD`, and a `zplug` block."""

import torch
from pydantic import BaseModel, ConfigDict, Field

from zcore.config import OptimizerSpec


class PlainSGDParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(gt=0)
    """Step size."""


class PlainSGD(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def build(groups, params):
    return PlainSGD(groups, lr=params.lr)


SPEC = OptimizerSpec("PlainSGD", PlainSGDParams, build, reduces_own_gradients=False)


class ZPlugBlock(BaseModel):
    """The `zplug` block of a ds_config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tag: str
    """A name."""
    warmup_steps: int = Field(0, ge=0)
    """A count."""
'''

ENTRY_POINTS = """
[zcore.optimizers]
PlainSGD = zplug:SPEC

[zcore.config_blocks]
zplug = zplug:ZPlugBlock
"""


def write_zplug(root: Path) -> Path:
    """Write `zplug` and its `zplug-0.0.0.dist-info` under `root`; returns `root` (the folder
    to put on `sys.path`)."""
    (root / "zplug").mkdir(parents=True, exist_ok=True)
    (root / "zplug" / "__init__.py").write_text(ZPLUG)
    info = root / "zplug-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zplug\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root
