"""The per-layer collective of tensor-parallel serving: gloo's ``all_reduce`` against the
point-to-point all-reduce zserve uses (:mod:`zserve.tp.p2p`), same ranks, same run; and the
logits' gather to rank 0 both ways.

``world`` rank processes (one torch thread each, each pinned to a core of its own where
there are enough, as ``TPRunner`` pins its ranks) join one :class:`zserve.tp.group.TPGroup`
and time, alternating ``repeats`` times, ``iters`` in-place all-reduces of an fp32
``(rows, hidden)`` tensor for each ``rows``:

* ``gloo``: ``dist.all_reduce`` on the group's gloo ``tp`` group;
* ``p2p``: ``TPGroup.all_reduce`` with the point-to-point path (what a layer calls).

Each op is timed alone (its median is robust to a loaded machine's preemptions); each starts
from the same input (a ``copy_`` outside the timing). Printed per shape: rank 0's median
microseconds per all-reduce of each, the ratio gloo / p2p, and whether the two sums are
bit-identical on every rank (``same_sum``). With ``gather_cols`` (> 0) the same for a gather
to rank 0 of ``(gather_rows, gather_cols)`` fp32 per rank (the logits' gather of a step):
``dist.gather`` against the point-to-point gather.

Defaults: 2 ranks, hidden 576 (SmolLM2), rows 1 (a batch-1 decode step) and 16 (16
sequences decoding), gather (16, 24576) (half of SmolLM2's vocab per rank). Run:
``python -c "from zstack.bench import load; b = load('serve_tp_collectives');
print(b.report(b.run()))"``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from zcore.bench import load

_ranks = load("_ranks", Path(__file__).parent)


def run(
    world: int = 2,
    hidden: int = 576,
    rows: str | list[int] = "1,16",
    iters: int = 300,
    repeats: int = 3,
    gather_rows: int = 16,
    gather_cols: int = 24576,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Time both ways on ``world`` ranks (see the module docstring)."""
    shapes = [int(r) for r in rows.split(",")] if isinstance(rows, str) else list(rows)
    if world < 2 or hidden < 1 or iters < 1 or repeats < 1 or not shapes or gather_cols < 0:
        raise ValueError(
            f"world {world} (>= 2), hidden {hidden}, iters {iters}, repeats {repeats} "
            f"(each >= 1), gather_cols {gather_cols} (>= 0) and rows {rows!r} (a list of "
            "counts) are needed"
        )
    spec = dict(
        hidden=hidden, rows=shapes, iters=iters, repeats=repeats, gather=[gather_rows, gather_cols]
    )
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tp-collectives-") as work:
        outs = _ranks.launch(
            __file__, world, spec, work, timeout_s=timeout_s, what="serve_tp_collectives"
        )
    first = outs[0]
    results = []
    for i, r in enumerate(shapes):
        gloo, p2p = (statistics.median(first[k][i]) for k in ("gloo", "p2p"))
        results.append(
            dict(
                rows=r,
                hidden=hidden,
                bytes=r * hidden * 4,
                gloo_us=round(gloo * 1e6, 1),
                p2p_us=round(p2p * 1e6, 1),
                ratio=round(gloo / p2p, 2),
                same_sum=all(o["same"][i] for o in outs),
            )
        )
    gather = None
    if gather_cols:
        gloo, p2p = (statistics.median(first["gather"][k]) for k in ("gloo", "p2p"))
        gather = dict(
            rows=gather_rows,
            cols=gather_cols,
            gloo_us=round(gloo * 1e6, 1),
            p2p_us=round(p2p * 1e6, 1),
            ratio=round(gloo / p2p, 2),
            same=first["gather"]["same"],
        )
    return dict(
        benchmark="serve_tp_collectives",
        world=world,
        collectives=first["collectives"],
        iters=iters,
        repeats=repeats,
        cpu=_ranks.cpu_name(),
        load_avg=[load_before[0], os.getloadavg()[0]],
        results=results,
        gather=gather,
    )


def report(result: dict[str, Any]) -> str:
    load_avg = result["load_avg"]
    lines = [
        f"all-reduce, {result['world']} ranks, fp32, median us per op "
        f"({result['iters']} ops x {result['repeats']} repeats; group uses "
        f"{result['collectives']}); {result['cpu']}, load {load_avg[0]:.1f} -> "
        f"{load_avg[1]:.1f}"
    ]
    for r in result["results"]:
        lines.append(
            f"  ({r['rows']}, {r['hidden']}) {r['bytes']} B: gloo {r['gloo_us']} us, "
            f"p2p {r['p2p_us']} us, gloo/p2p {r['ratio']}x, same sum {r['same_sum']}"
        )
    g = result.get("gather")
    if g:
        lines.append(
            f"gather to rank 0 of ({g['rows']}, {g['cols']}) fp32 a rank: dist.gather "
            f"{g['gloo_us']} us, p2p {g['p2p_us']} us, gloo/p2p {g['ratio']}x, same {g['same']}"
        )
    return "\n".join(lines)


def _timed(ops: dict[str, Any], reset: Any, iters: int, repeats: int, barrier: Any) -> dict:
    """Each op of ``ops`` ``iters`` times a block, blocks alternating ``repeats`` times: the
    seconds of every call, per op."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, op in ops.items():
            barrier()
            for _ in range(iters):
                reset()
                start = time.perf_counter()
                op()
                times[name].append(time.perf_counter() - start)
    return times


def _rank(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from zserve.tp.group import TPGroup
    from zserve.tp.runner import rank_cpus

    torch.set_num_threads(1)
    rank, world = spec["rank"], spec["world"]
    cpus = rank_cpus(rank, world, 1)  # as TPRunner pins its ranks
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    group = TPGroup.join(rank, world, spec["port"], 60.0, "p2p")
    assert group.p2p is not None
    barrier = lambda: dist.barrier(group=group.compute)  # noqa: E731
    out: dict[str, Any] = {"gloo": [], "p2p": [], "same": []}
    for rows in spec["rows"]:
        gen = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(rows, spec["hidden"], generator=gen)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, group=group.compute)
        group.all_reduce(b)
        out["same"].append(bool(torch.equal(a, b)))
        work = x.clone()
        ops = {
            "gloo": partial(dist.all_reduce, work, group=group.compute),
            "p2p": partial(group.all_reduce, work),
        }
        times = _timed(ops, partial(work.copy_, x), spec["iters"], spec["repeats"], barrier)
        out["gloo"].append(times["gloo"])
        out["p2p"].append(times["p2p"])
    g_rows, g_cols = spec["gather"]
    if g_cols:
        x = torch.full((g_rows, g_cols), float(rank))
        parts = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
        got = group.p2p.all_gather(x, everyone=False)
        dist.gather(x, parts, dst=0, group=group.compute)
        same = rank != 0 or bool(torch.equal(got, torch.stack(parts)))  # type: ignore[arg-type]
        ops = {
            "gloo": lambda: dist.gather(x, parts, dst=0, group=group.compute),
            "p2p": lambda: group.p2p.all_gather(x, everyone=False),  # type: ignore[union-attr]
        }
        iters = max(1, spec["iters"] // 10)
        out["gather"] = _timed(ops, lambda: None, iters, spec["repeats"], barrier)
        out["gather"]["same"] = same
    out["collectives"] = group.collectives
    group.close()
    _ranks.write_result(spec, out)


if __name__ == "__main__":  # one rank, started by run() through _ranks.launch
    spec = _ranks.rank_spec(sys.argv)
    if spec is None:
        sys.exit("this file runs as a rank of serve_tp_collectives; run run() instead")
    _rank(spec)
