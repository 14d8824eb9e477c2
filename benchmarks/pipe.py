"""Pipeline parallelism: zcore's engine against torch's Schedule1F1B and plain DDP.

A GPT of 6 ``z train`` blocks (width 576, vocabulary 2048, untied head: ~26.6M parameters)
on 2 gloo ranks, ``micro_batches`` micro-batches of ``micro_batch`` sequences of ``seq``
tokens per step, AdamW (``lr``, ``weight_decay`` 0.01 on every side), fp32, ``threads``
threads per rank (torch's and zcore's native kernels alike). The contenders, each in fresh
rank processes:

- ``ours``: ``zcore.pipe.PipelineModule`` + ``zcore.initialize`` (``pipeline.schedule``
  1F1B, ZeRO stage ``zero_stage``), ``engine.train_batch``;
- ``ours_zbv`` (with ``--zbv``): the same with ZB-V (4 stages, 2 per rank) and activation
  checkpointing every layer;
- ``torch_1f1b``: the same two stages as ``nn.Sequential`` in torch's ``PipelineStage``
  (static shapes) and ``Schedule1F1B`` used directly, ``torch.optim.AdamW`` per stage;
- ``ddp``: the whole model on each rank under ``DistributedDataParallel``, half the
  micro-batches each (``no_sync`` on all but the last), ``torch.optim.AdamW``.

One run per round holds every contender in the same ranks, stepping in turn (the order rotates
each step), so machine noise hits them alike: step times and their ratios come from it:
``vs_torch_1f1b`` is the ratio of the two sides' median steps, ``vs_torch_1f1b_paired`` the
median of each step's own ratio (ours over torch's in the same round: a noisy round moves
both). The bubble is measured from per-rank timelines: the time each rank spends inside
``PipelineStage``'s forward/backward computations, against the wall time of the schedule's
``step`` (``1 - busy / wall``, mean over ranks), next to the 1F1B theory
``(p - 1) / (m + p - 1)``. Then one run per contender alone gives each rank's peak RSS (``VmHWM``): the memory per
stage. Each step's time is also split into phases per rank (``phases_s_per_rank``: the
schedule, gradient reduction, norm, optimizer, publish, ``zero_grad``, loss, other;
``benchmarks/_pipe_phases.py``), so a gap between the sides shows where it lies.

Run: ``z bench pipe --json`` (or ``python benchmarks/pipe.py``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from zcore.bench import load

_ranks = load("_ranks", Path(__file__).parent)
_phases = load("_pipe_phases", Path(__file__).parent)

SIDES = ("ours", "torch_1f1b", "ddp")


def _layers(opt: dict[str, Any]) -> tuple[Any, list[Any]]:
    """The GPT's layer specs: embeddings, blocks, final norm + head."""
    import torch
    from torch import nn

    from zcore.pipe import LayerSpec
    from ztrain.gpt import Block, GPTConfig

    cfg = GPTConfig(
        vocab_size=opt["vocab"],
        n_layer=opt["layers"],
        n_head=8,
        n_embd=opt["width"],
        block_size=opt["seq"],
        tie_weights=False,
    )

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
            return self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_f = nn.LayerNorm(cfg.n_embd)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, V)
            return self.lm_head(self.ln_f(x))

    specs = [LayerSpec(Embed), *[LayerSpec(Block, cfg) for _ in range(cfg.n_layer)]]
    return cfg, [*specs, LayerSpec(Head)]


def _loss(logits: Any, y: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class _Timeline:
    """Busy time inside ``PipelineStage``'s computations and the schedule's wall time."""

    def __init__(self) -> None:
        from torch.distributed.pipelining import stage as st

        self.busy = 0.0
        base = st._PipelineStageBase
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(base, name, self._timed(getattr(base, name)))

    def _timed(self, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - start

        return run


def _build(side: str, opt: dict[str, Any], rank: int, world: int, phases: Any) -> Any:
    """A ``step(batch) -> loss`` for ``side`` (``batch``: the step's micro-batches), its
    phases timed into ``phases`` (``_pipe_phases``)."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    import zcore
    from zcore.pipe import PipelineModule

    _, specs = _layers(opt)
    m = opt["micro_batches"]
    if side.startswith("ours"):
        zbv = side == "ours_zbv"
        model = PipelineModule(
            specs,
            num_stages=world,
            loss_fn=_loss,
            seed_layers=True,
            virtual_stages=2 if zbv else 1,
            stage_order="v" if zbv else "loop",
            activation_checkpoint_interval=1 if zbv else 0,
        )
        config = {
            "train_micro_batch_size_per_gpu": opt["micro_batch"],
            "gradient_accumulation_steps": m,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": opt["lr"], "weight_decay": opt["weight_decay"]},
            },
            "zero_optimization": {"stage": opt["zero_stage"]},
            "pipeline": {"schedule": "zbv" if zbv else "1f1b"},
        }
        engine, *_ = zcore.initialize(model, config=config)
        _phases.time_engine(phases, engine)
        return lambda batch: float(engine.train_batch(iter(batch)))

    def seeded(idx: int) -> nn.Module:
        torch.manual_seed(1234 + idx)  # PipelineModule(seed_layers=True)'s seeds
        return specs[idx].build()

    if side == "ddp":
        model = nn.Sequential(*[seeded(i) for i in range(len(specs))])
        ddp = DistributedDataParallel(model)
        adam = _adam(model, opt, phases)
        share = m // world

        def forward_backward(mine: list[Any]) -> list[Any]:
            losses = []
            for i, (x, y) in enumerate(mine):
                ctx = ddp.no_sync() if i < share - 1 else _null()
                with ctx:
                    loss = _loss(ddp(x), y) / share
                    loss.backward()
                losses.append(loss.detach())
            return losses

        run_mbs = phases.wrap("schedule", forward_backward)
        total = phases.wrap("loss", lambda losses: float(sum(float(v) for v in losses)))

        def ddp_step(batch: list[Any]) -> float:
            losses = run_mbs(batch[rank * share : (rank + 1) * share])
            adam.step()
            adam.zero_grad()
            return total(losses)

        return ddp_step
    bounds = PipelineModule(specs, num_stages=world, partition_method="parameters").parts
    own = nn.Sequential(*[seeded(i) for i in range(bounds[rank], bounds[rank + 1])])
    x0 = torch.zeros(opt["micro_batch"], opt["seq"], dtype=torch.long)
    act = torch.zeros(opt["micro_batch"], opt["seq"], opt["width"], requires_grad=True)
    logits = torch.zeros(opt["micro_batch"], opt["seq"], opt["vocab"], requires_grad=True)
    stage = PipelineStage(
        own,
        rank,
        world,
        torch.device("cpu"),
        input_args=x0 if rank == 0 else act,
        output_args=logits if rank == world - 1 else act,
    )
    sched = Schedule1F1B(stage, m, loss_fn=_loss)
    adam = _adam(own, opt, phases)
    phases.patch(sched, "step", "schedule")
    mean = phases.wrap("loss", lambda losses: float(sum(float(v) for v in losses) / m))

    def torch_step(batch: list[Any]) -> float:
        losses: list[Any] = []
        kw = {"target_mbs": [y for _, y in batch], "losses": losses} if rank == world - 1 else {}
        args = [(x,) for x, _ in batch] if rank == 0 else None
        sched.step(arg_mbs=args, return_outputs=False, **kw)
        adam.step()
        adam.zero_grad()
        return mean(losses) if losses else 0.0

    return torch_step


def _adam(model: Any, opt: dict[str, Any], phases: Any) -> Any:
    """``torch.optim.AdamW`` with zcore's hyperparameters (lr, weight decay; torch's
    defaults otherwise, as zcore's), its step and ``zero_grad`` timed."""
    import torch

    adam = torch.optim.AdamW(model.parameters(), lr=opt["lr"], weight_decay=opt["weight_decay"])
    phases.patch(adam, "step", "optimizer")
    phases.patch(adam, "zero_grad", "zero_grad")
    return adam


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _rank_main(spec: dict[str, Any]) -> None:
    """One rank of one run: build each contender, step them in turn, write JSON."""
    rank, world, opt, sides = spec["rank"], spec["world"], spec["options"], spec["sides"]
    import torch
    import torch._dynamo
    import torch.distributed as dist

    torch.set_num_threads(opt["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    timeline = _Timeline()
    phases = _phases.Phases()
    steps = {side: _build(side, opt, rank, world, phases) for side in sides}
    g = torch.Generator().manual_seed(opt["seed"])
    total = opt["warmup"] + opt["steps"]
    shape = (total, opt["micro_batches"], opt["micro_batch"], opt["seq"] + 1)
    tokens = torch.randint(0, opt["vocab"], shape, generator=g)
    out = {s: {"times": [], "busy": [], "losses": [], "phases": []} for s in sides}
    for t in range(total):
        batch = [(mb[:, :-1], mb[:, 1:]) for mb in tokens[t]]
        for k in range(len(sides)):
            side = sides[(t + k) % len(sides)]
            dist.barrier()
            timeline.busy = 0.0
            phases.reset()
            start = time.perf_counter()
            loss = steps[side](batch)
            dist.barrier()
            if t >= opt["warmup"]:
                took = time.perf_counter() - start
                out[side]["times"].append(took)
                out[side]["busy"].append(timeline.busy)
                out[side]["losses"].append(loss)
                out[side]["phases"].append(phases.split(took))
    result = {"sides": out, "peak_rss_mb": _ranks.memory_mb()["VmHWM"]}
    dist.destroy_process_group()
    _ranks.write_result(spec, result)


def _launch(sides: list[str], opt: dict[str, Any], tmp: str) -> list[dict[str, Any]]:
    spec = {"sides": sides, "options": opt}
    threads = str(opt["threads"])  # torch's kernels and zcore's native ones alike
    env = {**os.environ, "OMP_NUM_THREADS": threads, "ZNATIVE_NUM_THREADS": threads}
    return _ranks.launch(
        __file__, 2, spec, tmp, timeout_s=opt["timeout_s"], what=f"pipe {sides}", env=env
    )


def _summary(ranks: list[dict[str, Any]], side: str, m: int, p: int) -> dict[str, Any]:
    per = [r["sides"][side] for r in ranks]
    steps = [max(ts) for ts in zip(*(r["times"] for r in per), strict=True)]
    bubbles = []
    if side != "ddp":
        for r in per:
            bubbles.append(
                statistics.median(1 - b / w for b, w in zip(r["busy"], r["times"], strict=True))
            )
    pick = statistics.mean if side == "ddp" else max  # DDP: each rank's half; else the last stage's
    losses = [pick(r["losses"][i] for r in per) for i in range(len(steps))]
    return {
        "median_step_s": statistics.median(steps),
        "step_s": steps,
        "bubble_per_rank": bubbles or None,
        "bubble": statistics.mean(bubbles) if bubbles else None,
        "bubble_theory_1f1b": (p - 1) / (m + p - 1),
        "final_loss": losses[-1],
        "phases_s_per_rank": _phases.median_per_rank([r["phases"] for r in per]),
    }


def run(
    steps: int = 9,
    warmup: int = 2,
    micro_batches: int = 8,
    micro_batch: int = 1,
    seq: int = 128,
    layers: int = 6,
    width: int = 576,
    vocab: int = 2048,
    zero_stage: int = 1,
    zbv: bool = True,
    threads: int = 1,
    lr: float = 1e-4,
    weight_decay: float = 0.01,
    seed: int = 0,
    memory: bool = True,
    timeout_s: float = 1800,
) -> dict[str, Any]:
    """Time the contenders together, then each alone for its memory; JSON-able result."""
    if micro_batches < 2 or micro_batches % 2 or steps < 1 or warmup < 0:
        raise ValueError(
            f"need an even micro_batches >= 2 (DDP splits them over 2 ranks), steps >= 1, "
            f"warmup >= 0; got {micro_batches}, {steps}, {warmup}"
        )
    opt = dict(
        steps=steps,
        warmup=warmup,
        micro_batches=micro_batches,
        micro_batch=micro_batch,
        seq=seq,
        layers=layers,
        width=width,
        vocab=vocab,
        zero_stage=zero_stage,
        threads=threads,
        lr=lr,
        weight_decay=weight_decay,
        seed=seed,
        timeout_s=timeout_s,
    )
    sides = [*SIDES, *(["ours_zbv"] if zbv else [])]
    with tempfile.TemporaryDirectory(prefix="zbench-pipe-") as tmp:
        together = _launch(sides, opt, tmp)
        alone = {}
        if memory:
            quick = {**opt, "steps": 2, "warmup": 1}
            alone = {s: [r["peak_rss_mb"] for r in _launch([s], quick, tmp)] for s in sides}
    res = {s: _summary(together, s, micro_batches, 2) for s in sides}
    for s in sides:
        res[s]["peak_rss_mb_per_rank"] = alone.get(s)
    ours, t1f1b, ddp = (res[s]["median_step_s"] for s in SIDES)
    # The same steps side by side (the contenders step in turn within each): the median of
    # their ratios drops what a round's machine noise does to both sides.
    paired = [
        o / t for o, t in zip(res["ours"]["step_s"], res["torch_1f1b"]["step_s"], strict=True)
    ]
    n_params = _count(opt)
    return {
        "benchmark": "pipe",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "host": platform.node(),
        "cpu": _ranks.cpu_name(),
        "params": n_params,
        "world_size": 2,
        "options": opt,
        "sides": res,
        "vs_torch_1f1b": ours / t1f1b,
        "vs_torch_1f1b_paired": statistics.median(paired),
        "vs_torch_1f1b_per_step": paired,
        "vs_ddp": ours / ddp,
        "torch_1f1b_vs_ddp": t1f1b / ddp,
        "targets": {"vs_torch_1f1b": "<= 1.0", "vs_ddp": "<= 1.15", "memory": "<= ddp's"},
    }


def _count(opt: dict[str, Any]) -> int:
    _, specs = _layers(opt)
    return sum(p.numel() for s in specs for p in s.build_meta().parameters())


def report(result: dict[str, Any]) -> str:
    """A table a person can read; the JSON follows it."""
    o = result["options"]
    lines = [
        f"pipeline, GPT {o['layers']} layers ({result['params']:,} params), 2 gloo ranks, "
        f"{o['micro_batches']} micro-batches x {o['micro_batch']} x {o['seq']} tokens, AdamW, "
        f"median of {o['steps']} steps; {result['cpu']}",
        "side         step s   bubble (per rank)      theory  peak RSS MB/rank  final loss",
    ]
    for side, s in result["sides"].items():
        bub = (
            "-"
            if s["bubble"] is None
            else (f"{s['bubble']:.3f} ({'/'.join(f'{b:.3f}' for b in s['bubble_per_rank'])})")
        )
        rss = (
            "-"
            if not s["peak_rss_mb_per_rank"]
            else "/".join(f"{m:.0f}" for m in s["peak_rss_mb_per_rank"])
        )
        lines.append(
            f"{side:<11} {s['median_step_s']:7.3f}   {bub:<21} {s['bubble_theory_1f1b']:6.3f}"
            f"  {rss:>16}  {s['final_loss']:.4f}"
        )
    names = list(next(iter(result["sides"].values()))["phases_s_per_rank"])
    lines.append("phases, ms per step (rank 0/rank 1):")
    lines.append("side        " + " ".join(f"{n:>13}" for n in names))
    for side, s in result["sides"].items():
        per = s["phases_s_per_rank"]
        cells = ["/".join(f"{1000 * v:.0f}" for v in per[n]) for n in names]
        lines.append(f"{side:<11} " + " ".join(f"{c:>13}" for c in cells))
    lines.append(
        f"ours / torch 1F1B {result['vs_torch_1f1b']:.3f}x (median of the steps' own ratios "
        f"{result['vs_torch_1f1b_paired']:.3f}x), ours / DDP {result['vs_ddp']:.3f}x, "
        f"torch 1F1B / DDP {result['torch_1f1b_vs_ddp']:.3f}x"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    rank_spec = _ranks.rank_spec(sys.argv)
    if rank_spec is not None:  # one rank, started by run() through _ranks.launch
        _rank_main(rank_spec)
        sys.exit(0)
    out = run()
    print(report(out))
    print(json.dumps(out))
