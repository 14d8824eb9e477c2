"""The `z train` flags, as one frozen object (standard library only: `z --help` stays fast)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

# The default run (small, 2 ranks x 8 x 256 tokens) took 4:47 wall, 262 s of it training, on
# 2 CPU cores shared with other jobs; val loss 7.62 -> 5.08.
DEFAULT_STEPS = 150


class TrainError(Exception):
    """A run that cannot start as asked; the message says what to change."""


@dataclass(frozen=True)
class TrainOptions:
    """The `z train` flags (see `z train --help`)."""

    out: Path = Path("runs/shakespeare")
    preset: str = "small"
    steps: int = DEFAULT_STEPS
    """Optimizer steps of the whole run; `--resume` trains from the checkpoint's step to this."""
    stage: int = 3
    config: Path | None = None
    resume: bool = False
    micro_batch: int = 8
    grad_accum: int = 1
    seq_len: int | None = None
    """Tokens per sequence; None: the preset's (`ztrain.gpt.default_seq_len`: its block_size,
    at most 256)."""
    lr: float = 1e-3
    eval_every: int | None = None
    """Steps between validation passes; None: a tenth of `steps`."""
    seed: int = 0
    vocab_size: int = 2048
    bf16: bool = False
    save_every: int = 0
    """Steps between checkpoints; 0 saves at the end only."""
    moe: bool = False
    """Train the Mixtral-architecture MoE model (`moe_lm.py`) instead of the GPT."""
    moe_experts: str = "8"
    """Experts per MoE layer: one count, or counts for equal consecutive groups of the MoE
    layers (PR-MoE's pyramid, e.g. `4,8`)."""
    moe_top_k: int = 2
    moe_layers: str = "every"
    """Which layers are MoE: `every` or `every-other` (1, 3, 5, ...)."""
    moe_capacity_factor: float = 1.0
    moe_dropless: bool = False
    moe_ep: int = 1
    """Expert-parallel size (ep_size)."""
    moe_aux_coef: float = 0.01
    """Weight of the summed load-balancing losses in the training loss (DeepSpeed's 0.01)."""
    dense_twin: bool = False
    """Train the MoE model's dense twin: the same architecture with one SwiGLU of `top-k x`
    the expert width per layer (the same active parameters)."""
    pp: int = 1
    """Pipeline stages (`zcore.pipe`): the GPT's blocks cut into `pp` stages."""
    tp: int = 1
    """Tensor-parallel ranks: each layer cut over `tp` ranks (`zcore.tensor`)."""
    schedule: str = "1f1b"
    """The pipeline schedule (`gpipe`, `1f1b`, `interleaved_1f1b`)."""
    microbatches: int | None = None
    """Micro-batches per step under `--pp` (`gradient_accumulation_steps`); None:
    `--grad-accum` when given, else 2 x pp."""
    cp: int = 1
    """Ranks sharing each sequence, each training a slice of it (sequence parallelism,
    `sequence_parallel_size`; `ztrain.gpt_cp`)."""
    cp_mode: str = "ulysses"
    """How attention spans the `cp` ranks: "ulysses" (heads split over cp) or "ring"
    (key/value blocks passed around; `sequence_parallel_mode`)."""
    explicit: frozenset[str] = field(default_factory=frozenset)
    """Option names given on the command line (only those are reported as overridden)."""

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    @property
    def eval_interval(self) -> int:
        return self.eval_every or max(1, self.steps // 10)


def cache_dir() -> Path:
    """Tokenizer and encoded-corpus cache: `$ZSTACK_CACHE` or `~/.cache/zstack/shakespeare`."""
    env = os.environ.get("ZSTACK_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "zstack" / "shakespeare"
