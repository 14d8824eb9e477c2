"""`import zcore` stays light (no torch, no engine), and its public submodules load on first
use, so `import zcore` then `zcore.zero.Init()` works as `deepspeed.zero.Init()` does after
`import deepspeed`. Measured in a fresh interpreter: one plain (single-rank) run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import zcore

SCRIPT = r"""
import json, sys
import zcore

after_import = sorted(m for m in sys.modules if m.split(".")[0] in
                      {"zcore", "torch", "pydantic", "numpy", "znative"})
import torch
with zcore.zero.Init(persistence_threshold=10):
    layer = torch.nn.Linear(8, 8)
print(json.dumps({
    "after_import": after_import,
    "init": type(zcore.zero).__name__ + ":" + zcore.zero.Init.__module__,
    "partitioned": layer.weight.numel(),
    "resolved": [zcore.checkpoint.save.__module__, zcore.optim.CPUAdam.__module__,
                 zcore.config.ZConfig.__module__, zcore.comm.__name__,
                 zcore.lr_schedules.__name__, zcore.engine.ZEngine.__module__],
}))
"""


def test_import_is_light_and_submodules_resolve_lazily() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after_import"] == ["zcore"]  # as before the lazy attributes: nothing else
    assert got["init"] == "module:zcore.zero.init"
    assert got["partitioned"] == 0  # the 64-element weight lives in its shard, not the module
    assert got["resolved"] == [
        "zcore.checkpoint.sharded",
        "zcore.optim.cpu_adam",
        "zcore.config.root",
        "zcore.comm",
        "zcore.lr_schedules",
        "zcore.engine",
    ]


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'zcore' has no attribute 'nope'"):
        zcore.nope  # noqa: B018
    assert {"zero", "checkpoint", "optim", "config", "comm", "initialize"} <= set(dir(zcore))
