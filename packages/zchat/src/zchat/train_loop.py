"""What the training stages share: the ZeRO config, the schedule, the batch order, answer
log-probabilities, held-out sharding, and the progress line + metrics JSONL.

Batches are deterministic and known to every rank: step ``s`` takes the next
``micro_batch * grad_accum * world`` items of a seeded shuffle of the training split
(reshuffled each pass), and rank ``r`` takes items ``[r*n, (r+1)*n)`` of it (``n`` =
micro_batch * grad_accum), micro-batch ``m`` being the ``m``-th ``micro_batch`` of those.
So a loss normalised by the whole step's answer-token count (which every rank computes
from the same global batch, without communication) gives gradients that are exactly the
single-process mean over the global batch once ZeRO averages them over ranks.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zchat.config import StageConfig
from zcore.process import rss_bytes

T = TypeVar("T")


def ds_config(cfg: StageConfig, world: int) -> dict[str, Any]:
    """The zcore (DeepSpeed-format) config of a stage: AdamW, clipping, ZeRO stage."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.micro_batch * cfg.grad_accum * world,
        "gradient_clipping": cfg.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay}},
        "zero_optimization": {
            "stage": cfg.zero_stage,
            "stage3_param_persistence_threshold": cfg.persistence_threshold,
        },
        "steps_per_print": 10**9,  # zchat prints its own progress line
        "comm_timeout_s": 600,
    }


def lr_factor(cfg: StageConfig, step: int) -> float:
    """The multiple of ``cfg.lr`` used by optimizer step ``step`` (0-based): linear warmup,
    then constant or cosine to 0 at ``cfg.steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, cfg.steps - cfg.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * (step - cfg.warmup_steps) / span))


def scheduler_for(cfg: StageConfig) -> Callable[[Any], Any]:
    """``optimizer -> LambdaLR`` of :func:`lr_factor` (what ``zcore.initialize`` takes)."""
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))


def global_batches(items: Sequence[T], per_step: int, steps: int, seed: int) -> list[list[T]]:
    """``steps`` lists of ``per_step`` items: passes over a seeded shuffle of ``items``."""
    rng = random.Random(f"zchat-order-{seed}")
    order: list[int] = []
    out = []
    for _ in range(steps):
        while len(order) < per_step:
            fresh = list(range(len(items)))
            rng.shuffle(fresh)
            order += fresh
        out.append([items[i] for i in order[:per_step]])
        order = order[per_step:]
    return out


def rank_micro_batches(batch: Sequence[T], rank: int, world: int, micro: int) -> list[list[T]]:
    """This rank's micro-batches of a global batch (rank-major, see the module doc)."""
    n = len(batch) // world
    mine = batch[rank * n : (rank + 1) * n]
    return [list(mine[i : i + micro]) for i in range(0, n, micro)]


def heldout_shard(
    items: Sequence[T], rank: int, world: int, batch: int
) -> list[list[tuple[T, bool]]]:
    """This rank's held-out batches as (item, counted) pairs. Every rank gets the same number
    of batches of the same size (ZeRO-3 forwards are collective), padded with uncounted
    repeats of the first item."""
    per_rank = -(-len(items) // world)
    per_rank = -(-per_rank // batch) * batch
    mine = [
        (items[i], True) for i in range(rank * per_rank, min(len(items), (rank + 1) * per_rank))
    ]
    mine += [(items[0], False)] * (per_rank - len(mine))
    return [mine[i : i + batch] for i in range(0, per_rank, batch)]


def answer_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each label token ``[B, T-1]``, its mask ``[B, T-1]``): position ``t``
    predicts token ``t+1``; prompt and padding (label -100) are masked."""
    target = labels[:, 1:]
    mask = target != -100
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(2, target.clamp(min=0).unsqueeze(2)).squeeze(2)
    return picked * mask, mask


def answer_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the answer tokens (labels != -100)."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def causal_lm_class(path: str | os.PathLike[str]) -> Any:
    """The transformers causal-LM class of a model directory (``LlamaForCausalLM``, ...)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def all_sum(*values: float) -> list[float]:
    """Each value summed over ranks (one all-reduce)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


class Recorder:
    """The metrics JSONL (rank 0) and the progress output (rank 0) of a stage.

    Records go to ``path``, by default ``<out>.metrics.jsonl`` beside the stage's output
    directory. :meth:`step` is collective: every rank reports its resident memory, so the
    stdout line shows memory per rank. :meth:`progress` is the one-line alternative for
    loops that print their own line (rewritten in place on stderr)."""

    def __init__(
        self,
        stage: str,
        out: str | os.PathLike[str],
        steps: int,
        rank: int,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.stage, self.steps, self.rank = stage, steps, rank
        default = Path(out).with_name(Path(out).name + ".metrics.jsonl")
        self.path = Path(path) if path is not None else default
        self.start = self.last = time.perf_counter()
        if rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (rank 0)."""
        if self.rank == 0:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def progress(self, line: str) -> None:
        """Show ``line`` in place of the previous one on stderr (rank 0)."""
        if self.rank == 0:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)

    def end_progress(self) -> None:
        """End the in-place line (rank 0)."""
        if self.rank == 0:
            print(file=sys.stderr)

    def step(self, step: int, tokens: int, **metrics: float) -> None:
        """Record optimizer step ``step`` (1-based) that processed ``tokens`` tokens over all
        ranks since the previous record."""
        now = time.perf_counter()
        mem = [0] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(mem, rss_bytes())
        else:
            mem = [rss_bytes()]
        rate = tokens / max(now - self.last, 1e-9)
        self.last = now
        record = {
            "stage": self.stage,
            "step": step,
            **metrics,
            "tokens_per_s": rate,
            "rss_bytes": mem,
            "elapsed_s": now - self.start,
        }
        self.write(record)
        if self.rank == 0:
            shown = " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
            gib = "/".join(f"{m / 2**30:.2f}" for m in mem)
            print(
                f"[{self.stage}] step {step}/{self.steps} {shown} tok/s {rate:.0f} "
                f"mem/rank GiB {gib}",
                flush=True,
            )


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """(fn(), seconds it took)."""
    start = time.perf_counter()
    return fn(), time.perf_counter() - start


def cycle(items: Sequence[T]) -> Iterator[T]:
    while True:
        yield from items
