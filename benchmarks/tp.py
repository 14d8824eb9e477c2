"""Tensor parallelism at tp 2: zcore's layers against DTensor and against data parallelism.

Two gloo ranks train the same untied ``z train`` GPT (``--preset``, vocabulary 2048) three
ways in one run, taking turns step by step (the order rotating every repeat, so load from
other processes hits them alike):

- ``zcore_tp``: :func:`zcore.tensor.parallelize` at tp 2 under ``zcore.initialize``
  (ZeRO stage 0, AdamW): one global batch of ``--micro-batch`` sequences, both ranks;
- ``dtensor_tp``: the same GPT cut by torch's ``parallelize_module``
  (:mod:`zcore.tensor.dtensor_ref`: ``ColwiseParallel``/``RowwiseParallel``, logits
  gathered for the loss) with ``torch.optim.AdamW(foreach=False)``, since DTensor
  parameters cannot go into ZeRO's flat buffers;
- ``dtensor_tp_lp``: the same with the logits left sharded and torch's ``loss_parallel()``
  (vocabulary-parallel cross-entropy, as zcore's plan computes it);
- ``dp``: zcore's engine at tp 1, dp 2 (stage 0: an all-reduce of every gradient, DDP's
  algorithm), each rank half of the same global batch.

A sample is one optimizer step (forward, backward, step) after a barrier; medians over
``--steps`` after ``--warmup``. ``vs_dtensor`` (against the faster DTensor variant; each
variant's ratio is there too) and ``vs_dp`` are ``zcore_tp``'s median step time divided by
the peer's (below 1: ours is faster). ``state_vs_tp1`` is ``zcore_tp``'s
parameter + optimizer-state bytes on a rank (its shards, the fp32 master, Adam's moments)
over ``dp``'s (the whole model, as tp 1 holds it); the target is at most 0.55.

Run: ``z bench tp --json``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from zcore.bench import load

_ranks = load("_ranks", Path(__file__).parent)

CONTENDERS = ("zcore_tp", "dtensor_tp", "dtensor_tp_lp", "dp")
TARGETS = {"vs_dtensor": 1.0, "state_vs_tp1": 0.55}
LR = 1e-3


def _config(mb: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 0},
        "comm_timeout_s": 600,
    }


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Engine:
    """A zcore engine contender: one step on this rank's rows of the global batch."""

    def __init__(self, model: Any, spec: Any, mb: int, rows: slice) -> None:
        import zcore

        self.engine, *_ = zcore.initialize(model, config=_config(mb), mesh=spec)
        self.rows = rows

    def step(self, x: Any, y: Any) -> float:
        _, loss = self.engine(x[self.rows], y[self.rows])
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())

    def state_bytes(self) -> int:
        return _bytes(self.engine.module.parameters()) + self.engine.zopt.store.optimizer_bytes()


class _DTensor:
    def __init__(self, model: Any, loss_parallel: bool) -> None:
        import contextlib

        import torch
        from torch.distributed.tensor.parallel import loss_parallel as lp

        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)
        self.context = lp if loss_parallel else contextlib.nullcontext

    def step(self, x: Any, y: Any) -> float:
        with self.context():
            _, loss = self.model(x, y)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    def state_bytes(self) -> int:
        def local(t: Any) -> Any:
            return t.to_local() if hasattr(t, "to_local") else t

        params = [local(p) for p in self.model.parameters()]
        state = [local(v) for s in self.opt.state.values() for v in s.values() if v.dim()]
        return _bytes(params) + _bytes(state)


def _worker(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from zcore.comm import MeshSpec, job_mesh
    from zcore.tensor import parallelize
    from zcore.tensor.dtensor_ref import dtensor_gpt
    from ztrain.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    rank, world, mb = spec["rank"], spec["world"], spec["micro_batch"]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = GPTConfig.preset(spec["preset"], vocab_size=2048, tie_weights=False)
    tp_spec, dp_spec = MeshSpec.resolve(world, tp=world), MeshSpec.resolve(world)
    half = mb // world
    tp_mesh = job_mesh(tp_spec, 600.0).device_mesh["tp"]
    runs = {
        "zcore_tp": _Engine(parallelize(GPT(cfg, seed=0), tp_spec), tp_spec, mb, slice(0, mb)),
        "dtensor_tp": _DTensor(dtensor_gpt(GPT(cfg, seed=0), tp_mesh), False),
        "dtensor_tp_lp": _DTensor(dtensor_gpt(GPT(cfg, seed=0), tp_mesh, True), True),
        "dp": _Engine(GPT(cfg, seed=0), dp_spec, half, slice(rank * half, (rank + 1) * half)),
    }
    seq = min(spec["seq_len"], cfg.block_size)
    g = torch.Generator().manual_seed(0)
    total = spec["warmup"] + spec["steps"]
    tok = torch.randint(0, cfg.vocab_size, (total, mb, seq + 1), generator=g)
    times: dict[str, list[float]] = {n: [] for n in CONTENDERS}
    losses: dict[str, list[float]] = {n: [] for n in CONTENDERS}
    for i in range(total):
        x, y = tok[i, :, :-1], tok[i, :, 1:]
        for j in range(len(CONTENDERS)):
            name = CONTENDERS[(i + j) % len(CONTENDERS)]
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(runs[name].step(x, y))
            if i >= spec["warmup"]:
                times[name].append(time.perf_counter() - t0)
    out = {
        n: {"times": times[n], "losses": losses[n], "state_bytes": runs[n].state_bytes()}
        for n in CONTENDERS
    }
    for n in ("zcore_tp", "dp"):
        runs[n].engine.destroy()
    _ranks.write_result(spec, out)


def run(
    preset: str = "small",
    steps: int = 20,
    warmup: int = 3,
    micro_batch: int = 8,
    seq_len: int = 128,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    from ztrain.gpt import GPTConfig

    if micro_batch % 2:
        raise ValueError(f"--micro-batch {micro_batch} must be even: dp splits it over 2 ranks")
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps {steps} must be >= 1 and --warmup {warmup} >= 0")
    cfg = GPTConfig.preset(preset, vocab_size=2048, tie_weights=False)
    spec = {
        "preset": preset,
        "steps": steps,
        "warmup": warmup,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
    }
    with tempfile.TemporaryDirectory(prefix="zbench-tp-") as work:
        per_rank = _ranks.launch(
            Path(__file__), 2, spec, work, timeout_s=timeout_s, what="z bench tp"
        )
    contenders: dict[str, Any] = {}
    for n in CONTENDERS:
        # a step ends when its slowest rank does
        slowest = [max(r[n]["times"][i] for r in per_rank) for i in range(steps)]
        contenders[n] = {
            "step_time_s": statistics.median(slowest),
            "state_bytes_per_rank": max(r[n]["state_bytes"] for r in per_rank),
            "first_loss": per_rank[0][n]["losses"][0],
            "last_loss": statistics.fmean(r[n]["losses"][-1] for r in per_rank),
        }
    ours = contenders["zcore_tp"]
    return {
        "benchmark": "tp",
        "ranks": 2,
        "tp": 2,
        "model": {"preset": preset, "params": cfg.num_params(), "tie_weights": False},
        "global_batch": micro_batch,
        "seq_len": min(seq_len, cfg.block_size),
        "steps": steps,
        "warmup": warmup,
        "contenders": contenders,
        # against DTensor's faster variant (logits gathered, or loss_parallel)
        "vs_dtensor": ours["step_time_s"]
        / min(contenders[n]["step_time_s"] for n in ("dtensor_tp", "dtensor_tp_lp")),
        "vs_dtensor_gathered": ours["step_time_s"] / contenders["dtensor_tp"]["step_time_s"],
        "vs_dtensor_loss_parallel": ours["step_time_s"]
        / contenders["dtensor_tp_lp"]["step_time_s"],
        "vs_dp": ours["step_time_s"] / contenders["dp"]["step_time_s"],
        "state_vs_tp1": ours["state_bytes_per_rank"] / contenders["dp"]["state_bytes_per_rank"],
        "targets": TARGETS,
    }


def report(result: dict[str, Any]) -> str:
    m = result["model"]
    lines = [
        f"z bench tp: {m['preset']} GPT ({m['params'] / 1e6:.1f}M params, untied), 2 ranks, "
        f"global batch {result['global_batch']} x {result['seq_len']} tokens, median of "
        f"{result['steps']} steps after {result['warmup']}"
    ]
    for name, c in result["contenders"].items():
        lines.append(
            f"  {name:13s} {1000 * c['step_time_s']:8.1f} ms/step  params+optimizer "
            f"{c['state_bytes_per_rank'] / 2**20:7.1f} MiB/rank  loss {c['first_loss']:.3f} -> "
            f"{c['last_loss']:.3f}"
        )
    t = result["targets"]
    lines.append(
        f"  zcore_tp / best dtensor step time {result['vs_dtensor']:.2f}x (target <= "
        f"{t['vs_dtensor']:.2f}); / dp {result['vs_dp']:.2f}x; state vs tp 1 "
        f"{result['state_vs_tp1']:.2f}x (target <= {t['state_vs_tp1']:.2f})"
    )
    return "\n".join(lines)


if __name__ == "__main__":  # one rank, started by run() through _ranks.launch
    rank_spec = _ranks.rank_spec(sys.argv)
    if rank_spec is None:
        sys.exit("this file runs as a rank of `z bench tp`; run that instead")
    _worker(rank_spec)
