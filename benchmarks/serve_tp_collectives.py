"""The per-layer collective of tensor-parallel serving: gloo over loopback against the
shared-memory all-reduce (:mod:`zserve.tp.shm`), same ranks, same run.

``world`` rank processes (one torch thread each) join one :class:`zserve.tp.group.TPGroup`
(which maps the shared-memory segment) and time, alternating ``repeats`` times, ``iters``
in-place all-reduces of an fp32 ``(rows, hidden)`` tensor for each ``rows``:

* ``gloo``: ``dist.all_reduce`` on the group's gloo ``tp`` group (what serving used before);
* ``shm``: ``TPGroup.all_reduce`` with the shared-memory path (what a layer calls).

Each timed op starts from the same input (a ``copy_`` in both loops). Printed per shape:
rank 0's median microseconds per all-reduce of each and the ratio gloo / shm, and whether
the two sums are bit-identical on every rank (``same_sum``).

Defaults: 2 ranks, hidden 576 (SmolLM2), rows 1 (a batch-1 decode step) and 16 (16
sequences decoding). Run: ``python -c "from zstack.bench import load;
b = load('serve_tp_collectives'); print(b.report(b.run()))"``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from zcore.bench import load

_ranks = load("_ranks", Path(__file__).parent)


def run(
    world: int = 2,
    hidden: int = 576,
    rows: str | list[int] = "1,16",
    iters: int = 500,
    repeats: int = 5,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Time both collectives on ``world`` ranks (see the module docstring)."""
    shapes = [int(r) for r in rows.split(",")] if isinstance(rows, str) else list(rows)
    if world < 2 or hidden < 1 or iters < 1 or repeats < 1 or not shapes:
        raise ValueError(
            f"world {world} (>= 2), hidden {hidden}, iters {iters}, repeats {repeats} "
            f"(each >= 1) and rows {rows!r} (a list of counts) are needed"
        )
    spec = dict(hidden=hidden, rows=shapes, iters=iters, repeats=repeats)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tp-collectives-") as work:
        outs = _ranks.launch(
            __file__, world, spec, work, timeout_s=timeout_s, what="serve_tp_collectives"
        )
    first = outs[0]
    results = []
    for i, r in enumerate(shapes):
        gloo = statistics.median(first["gloo"][i])
        shm = statistics.median(first["shm"][i])
        results.append(
            dict(
                rows=r,
                hidden=hidden,
                bytes=r * hidden * 4,
                gloo_us=round(gloo * 1e6, 1),
                shm_us=round(shm * 1e6, 1),
                ratio=round(gloo / shm, 1),
                same_sum=all(o["same"][i] for o in outs),
            )
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
            f"shm {r['shm_us']} us, gloo/shm {r['ratio']}x, same sum {r['same_sum']}"
        )
    return "\n".join(lines)


def _rank(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from zserve.tp.group import TPGroup

    torch.set_num_threads(1)
    rank, world = spec["rank"], spec["world"]
    group = TPGroup.join(rank, world, spec["port"], 60.0, "shm")
    gloo: list[list[float]] = []
    shm: list[list[float]] = []
    same: list[bool] = []
    for rows in spec["rows"]:
        gen = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(rows, spec["hidden"], generator=gen)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, group=group.compute)
        group.all_reduce(b)
        same.append(bool(torch.equal(a, b)))
        contenders = {
            "gloo": lambda t: dist.all_reduce(t, group=group.compute),
            "shm": group.all_reduce,
        }
        times: dict[str, list[float]] = {"gloo": [], "shm": []}
        work = x.clone()
        for _ in range(spec["repeats"]):
            for name, op in contenders.items():
                dist.barrier(group=group.compute)
                start = time.perf_counter()
                for _ in range(spec["iters"]):
                    work.copy_(x)
                    op(work)
                times[name].append((time.perf_counter() - start) / spec["iters"])
        gloo.append(times["gloo"])
        shm.append(times["shm"])
    collectives = group.collectives
    group.close()
    _ranks.write_result(spec, dict(gloo=gloo, shm=shm, same=same, collectives=collectives))


if __name__ == "__main__":  # one rank, started by run() through _ranks.launch
    spec = _ranks.rank_spec(sys.argv)
    if spec is None:
        sys.exit("this file runs as a rank of serve_tp_collectives; run run() instead")
    _rank(spec)
