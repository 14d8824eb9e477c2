"""Training over a slow link: compressed optimizers and ZeRO++ against their baselines.

Runs the `z train` recipe (the GPT on Shakespeare, preset ``tiny`` by default: same seed,
same data, same steps for every entry) on ranks split across two "nodes": two Linux network
namespaces joined by one veth pair rate-limited with ``tc`` (``benchmarks/_netns.py``),
gloo bound to that link (``GLOO_SOCKET_IFNAME``), ``MASTER_ADDR`` the first namespace's
address. On 2 ranks each node holds one rank; on 4 ranks each holds two
(``LOCAL_WORLD_SIZE=2``), whose traffic stays on the node's loopback.

Entries (each compared with the baseline measured in the same run, at the same rate):

* 2 ranks, ZeRO 0: ``adam`` (baseline), ``onebit_adam``, ``zero_one_adam``, ``onebit_lamb``
  (against ``lamb``: zcore's ``Lamb`` type if registered, else 1-bit LAMB never frozen);
* 4 ranks (2 nodes x 2), ZeRO 3: ``zero3`` (baseline), ``qwz``
  (``zero_quantized_weights``), ``hpz`` (``zero_hpz_partition_size: 2``), ``qgz``
  (``zero_quantized_gradients``) and ``zeropp`` (all three).

An entry whose config zcore refuses (an optimizer type or ZeRO++ key not registered yet)
is reported ``"unavailable"`` with the error text, and the rest still run. The 1-bit
optimizers get ``freeze_step = warmup`` (0/1 Adam: ``var_freeze_step``); step time is the
median over the steps after ``warmup`` (for every entry, so the windows match), each step's
time the slowest rank's. Bytes per step are what the engine's accounting says a rank sent
(``zcore.comm.accounting``; mean over ranks and over the timed steps), intra-node and
inter-node, and per op kind (``bytes_per_step_by_op``: which collectives a mode shrinks).
A config the engine refuses only when it starts (a ConfigError on the ranks) is
``"unavailable"`` too; any other error is ``"failed"``, with its text. Where namespaces cannot be made (not root, no iproute2) it says why and runs
on loopback, unlimited, still reporting bytes.

Run: ``z bench comm --json`` (default 100mbit, 2 and 4 ranks, 30 steps, 10 warm-up).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zcore.bench import load

_netns = load("_netns", Path(__file__).parent)
_ranks = load("_ranks", Path(__file__).parent)

LR = 1e-3
# The 4-rank runs partition every weight matrix (the tiny GPT's are below the default
# persistence threshold, which would keep them whole and all-gathered in full precision
# after each step) and gather them again for backward: the gathers ZeRO++ compresses.
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 1000, "stage3_max_reuse_distance": 0}


@dataclass(frozen=True)
class Entry:
    """One contender: its world size, the config keys it sets over `z train`'s, its baseline."""

    name: str
    world: int
    optimizer: str
    zero: dict[str, Any] = field(default_factory=dict)
    baseline: str | None = None
    freeze: str | None = None
    """The optimizer's freeze-step key (set to the warm-up steps), if it has one."""
    params: dict[str, Any] = field(default_factory=dict)
    """More optimizer params (``lamb``: 1-bit LAMB never frozen, i.e. LAMB itself)."""

    def config(self, warmup: int) -> dict[str, Any]:
        params: dict[str, Any] = {"lr": LR, "weight_decay": 0.0, **self.params}
        if self.freeze:
            params[self.freeze] = warmup
        return {
            "optimizer": {"type": self.optimizer, "params": params},
            "zero_optimization": {**(STAGE3 if self.world == 4 else {"stage": 0}), **self.zero},
            "comm_timeout_s": 600,
        }


def entries(lamb_registered: bool) -> list[Entry]:
    """Every entry, baselines first. LAMB is zcore's ``Lamb`` type when one is registered,
    else ``OneBitLamb`` with ``freeze_step`` past the end: the same LAMB rule (DeepSpeed's
    1-bit LAMB warm-up) on gradients averaged in full precision every step."""
    lamb = [
        Entry("lamb", 2, "Lamb")
        if lamb_registered
        else Entry("lamb", 2, "OneBitLamb", params={"freeze_step": 10**9})
    ]
    return [
        Entry("adam", 2, "Adam"),
        *lamb,
        Entry("onebit_adam", 2, "OneBitAdam", baseline="adam", freeze="freeze_step"),
        Entry("zero_one_adam", 2, "ZeroOneAdam", baseline="adam", freeze="var_freeze_step"),
        Entry(
            "onebit_lamb",
            2,
            "OneBitLamb",
            baseline="lamb",
            freeze="freeze_step",
        ),
        Entry("zero3", 4, "Adam"),
        Entry("qwz", 4, "Adam", {"zero_quantized_weights": True}, baseline="zero3"),
        Entry("hpz", 4, "Adam", {"zero_hpz_partition_size": 2}, baseline="zero3"),
        Entry("qgz", 4, "Adam", {"zero_quantized_gradients": True}, baseline="zero3"),
        Entry(
            "zeropp",
            4,
            "Adam",
            {
                "zero_quantized_weights": True,
                "zero_hpz_partition_size": 2,
                "zero_quantized_gradients": True,
            },
            baseline="zero3",
        ),
    ]


def _options(work: Path, name: str, cfg: Path, o: dict[str, Any]) -> Any:
    from ztrain.train_options import TrainOptions

    return TrainOptions(
        out=work / name,
        preset=o["preset"],
        steps=o["steps"],
        config=cfg,
        micro_batch=o["micro_batch"],
        seq_len=o["seq_len"],
        eval_every=o["steps"],
        seed=0,
    )


def _refusal(entry: Entry, cfg: Path, work: Path, o: dict[str, Any]) -> str | None:
    """The error zcore gives for ``entry``'s config (None: accepted)."""
    from ztrain.train_config import build_config

    try:
        build_config(_options(work, entry.name, cfg, o), entry.world)
    except Exception as err:  # ConfigError, an optimizer type not registered, ...
        return f"{type(err).__name__}: {err}"
    return None


# -- one rank -----------------------------------------------------------------------------
def _worker(spec: dict[str, Any]) -> None:
    """Train every entry of the spec on this rank (started by ``_ranks.launch``)."""
    from zcore.lifetime import die_with_parent

    # `_launch` gives its pid, as `z launch` does
    die_with_parent(int(os.environ["ZSTACK_LAUNCHER_PID"]), f"rank {os.environ['RANK']}")
    import torch

    from zcore.config import ConfigError
    from ztrain.train_plan import plan_run
    from ztrain.trainer import Trainer

    world = spec["world"]
    work, o = Path(spec["work"]), spec["options"]
    threads = max(1, (os.cpu_count() or 1) // world)
    out = []
    for e in spec["entries"]:
        row: dict[str, Any] = {"name": e["name"]}
        try:
            t = Trainer.start(plan_run(_options(work, e["name"], Path(e["config"]), o), world))
            torch.set_num_threads(threads)  # the node count's share, not the namespace's
            engine, times, intra, inter, losses = t.engine, [], [], [], []
            timed_from = engine.mesh.traffic()
            for step in range(o["steps"]):
                before = engine.mesh.traffic()
                if step == o["warmup"]:
                    timed_from = before
                start = time.perf_counter()
                losses.append(t.train_step(step))
                times.append(time.perf_counter() - start)
                sent = engine.mesh.traffic().minus(before).total
                intra.append(sent.intra)
                inter.append(sent.inter)
            per_op = engine.mesh.traffic().minus(timed_from).ops
            row.update(times=times, intra=intra, inter=inter, losses=losses)
            row["per_op"] = {k: v.total for k, v in per_op.items() if v.total}
            row["val_loss"] = t.evaluate()
            engine.destroy()
            del t, engine
        except Exception as err:  # reported per entry; the ranks fail alike on bad config
            row["error"] = f"{type(err).__name__}: {err}"
            row["refused"] = isinstance(err, ConfigError)
        out.append(row)
    _ranks.write_result(spec, out)


# -- the run ------------------------------------------------------------------------------
def _launch(
    world: int, link: Any, port: int, spec: dict[str, Any], tmp: Path, timeout_s: float
) -> list[list[dict[str, Any]]]:
    """Start ``world`` ranks (half in each namespace, or on loopback) on ``spec``; every
    rank's rows."""
    per_node = world // 2

    def placement(rank: int) -> tuple[list[str], dict[str, str]]:
        env = {
            "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
            "MASTER_ADDR": _netns.ADDRESSES[0] if link else "127.0.0.1",
            "GLOO_SOCKET_IFNAME": _netns.IFNAME if link else "lo",
            "PYTHONUNBUFFERED": "1",
        }
        return (link.exec_prefix(rank // per_node) if link else []), env

    what = f"z bench comm: {world} ranks"
    return _ranks.launch(
        __file__, world, spec, tmp, timeout_s=timeout_s, what=what, port=port, per_rank=placement
    )


def _summarize(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One entry's rows (one per rank) as its result."""
    errors = [r for r in rows if "error" in r]
    if errors:  # a config the engine refused (a feature not built yet) is unavailable
        status = "unavailable" if all(r["refused"] for r in errors) else "failed"
        return {"status": status, "error": errors[0]["error"]}
    steps = len(rows[0]["times"])
    slowest = [max(r["times"][s] for r in rows) for s in range(steps)]
    timed = slice(min(warmup, steps - 1), steps)

    def mean_bytes(key: str) -> int:
        return round(statistics.fmean(statistics.fmean(r[key][timed]) for r in rows))

    intra, inter = mean_bytes("intra"), mean_bytes("inter")
    return {
        "status": "ok",
        "step_time_s": statistics.median(slowest[timed]),
        "timed_steps": len(slowest[timed]),
        "bytes_per_step": {"intra": intra, "inter": inter, "total": intra + inter},
        "bytes_per_step_by_op": {
            k: round(statistics.fmean(r["per_op"].get(k, 0) for r in rows) / (steps - timed.start))
            for k in sorted({k for r in rows for k in r["per_op"]})
        },
        "final_loss": statistics.fmean(r["losses"][-1] for r in rows),
        "val_loss": rows[0]["val_loss"],
    }


def run(
    rates: str = "100mbit",
    ranks: str = "2,4",
    steps: int = 30,
    warmup: int = 10,
    entries_: str | None = None,
    preset: str = "tiny",
    seq_len: int = 64,
    micro_batch: int = 4,
    loopback: bool = False,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    from zcore.bench import numbers
    from zcore.config import optimizer_types

    worlds = numbers("--ranks", ranks)
    if bad := [w for w in worlds if w not in (2, 4)]:
        raise ValueError(f"--ranks {ranks!r}: {bad} not supported; give 2, 4 or 2,4")
    rate_list = [r.strip() for r in rates.split(",") if r.strip()]
    for r in rate_list:
        _netns.rate_bits(r)
    if not 0 <= warmup < steps:
        raise ValueError(f"--warmup {warmup} must be below --steps {steps}")
    every = entries("Lamb" in optimizer_types())
    chosen = [e for e in every if e.world in worlds]
    if entries_:
        names = [n.strip() for n in entries_.split(",") if n.strip()]
        known = {e.name for e in every}
        if unknown := [n for n in names if n not in known]:
            raise ValueError(f"--entries: unknown {unknown}; known: {', '.join(sorted(known))}")
        chosen = [e for e in chosen if e.name in names]
        if not chosen:
            raise ValueError(f"--entries {entries_!r}: none runs on --ranks {ranks}")
    o = {
        "preset": preset,
        "steps": steps,
        "warmup": warmup,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
    }

    link, reason = None, None
    if not loopback:
        try:
            link = _netns.Link.create()
        except OSError as err:
            reason = str(err)
            print(f"cannot create namespaces: {reason}; falling back to loopback", file=sys.stderr)
    runs: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="zbench-comm-") as tmp_name:
            tmp = Path(tmp_name)
            status: dict[str, dict[str, Any]] = {}
            configs: dict[str, Path] = {}
            for e in chosen:
                configs[e.name] = tmp / f"{e.name}.json"
                configs[e.name].write_text(json.dumps(e.config(warmup)))
                refused = _refusal(e, configs[e.name], tmp / "work", o)
                if refused:
                    status[e.name] = {"status": "unavailable", "error": refused}
            port = 29500
            for rate in rate_list if link else [None]:
                if link:
                    link.set_rate(rate)
                for world in worlds:
                    mine = [e for e in chosen if e.world == world]
                    todo = [e for e in mine if e.name not in status]
                    results = {e.name: status[e.name] for e in mine if e.name in status}
                    if todo:
                        spec = {
                            "work": str(tmp / "work"),
                            "options": o,
                            "entries": [
                                {"name": e.name, "config": str(configs[e.name])} for e in todo
                            ],
                        }
                        # a fresh port per launch (inside the namespaces every port is free)
                        port = port + 1 if link else _ranks.free_port()
                        per_rank = _launch(world, link, port, spec, tmp, timeout_s)
                        for i, e in enumerate(todo):
                            results[e.name] = _summarize([rows[i] for rows in per_rank], warmup)
                    for e in mine:
                        results[e.name]["config"] = e.config(warmup)
                    runs.append(
                        {
                            "ranks": world,
                            "nodes": 2,
                            "ranks_per_node": world // 2,
                            "rate": rate if link else "loopback (unlimited)",
                            "entries": {e.name: results[e.name] for e in mine},
                            "speedups": _speedups(mine, results),
                        }
                    )
    finally:
        if link:
            link.close()
    from ztrain.gpt import GPTConfig

    return {
        "benchmark": "comm",
        "transport": "netns" if link else "loopback",
        "fallback_reason": reason,
        "model": {
            "preset": preset,
            "params": GPTConfig.preset(preset, vocab_size=2048).num_params(),
        },
        "steps": steps,
        "warmup": warmup,
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "lamb_baseline": "Lamb" if "Lamb" in optimizer_types() else "OneBitLamb never frozen",
        "runs": runs,
    }


def _speedups(mine: list[Entry], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per entry with a baseline that both ran: baseline step time / its step time, and how
    many times fewer inter-node bytes it sent."""
    out: dict[str, Any] = {}
    for e in mine:
        r, b = results[e.name], results.get(e.baseline or "")
        if b is None or r.get("status") != "ok" or b.get("status") != "ok":
            continue
        inter = r["bytes_per_step"]["inter"]
        out[f"{e.name}_vs_{e.baseline}"] = {
            "step_time": b["step_time_s"] / r["step_time_s"],
            "inter_bytes": b["bytes_per_step"]["inter"] / inter if inter else None,
        }
    return out


def report(result: dict[str, Any]) -> str:
    lines = [
        f"z bench comm: {result['model']['preset']} GPT ({result['model']['params'] / 1e6:.1f}M "
        f"params), {result['steps']} steps, median after {result['warmup']}; "
        f"transport {result['transport']}"
        + (f" ({result['fallback_reason']})" if result["fallback_reason"] else "")
    ]
    for run_ in result["runs"]:
        lines.append(f"{run_['ranks']} ranks on 2 nodes, link {run_['rate']}:")
        for name, r in run_["entries"].items():
            if r["status"] != "ok":
                lines.append(f"  {name:14s} {r['status']}: {r['error'].splitlines()[0][:120]}")
                continue
            b = r["bytes_per_step"]
            lines.append(
                f"  {name:14s} {1000 * r['step_time_s']:8.1f} ms/step  sent/rank/step intra "
                f"{b['intra'] / 2**20:7.2f} MiB inter {b['inter'] / 2**20:7.2f} MiB  "
                f"loss {r['final_loss']:.4f} val {r['val_loss']:.4f}"
            )
        for name, s in run_["speedups"].items():
            ib = f", {s['inter_bytes']:.1f}x fewer inter-node bytes" if s["inter_bytes"] else ""
            lines.append(f"  {name}: {s['step_time']:.2f}x step time{ib}")
    return "\n".join(lines)


if __name__ == "__main__":  # one rank, started by run() through _ranks.launch
    rank_spec = _ranks.rank_spec(sys.argv)
    if rank_spec is None:
        sys.exit("this file runs as a rank of `z bench comm`; run that instead")
    _worker(rank_spec)
