"""ZeRO-Offload and ZeRO-Infinity: step time and peak memory per rank, with and without offload.

The `z train` GPT (default preset "medium", ~26.8M parameters, fp32, AdamW) on N gloo
ranks at one ZeRO stage, run in fresh rank processes once per mode:

- ``none``: zcore's in-memory optimizer (the baseline);
- ``cpu``: ``offload_optimizer.device = "cpu"``;
- ``nvme``: ``offload_optimizer.device = "nvme"`` under ``--dir``, tiles of ``sub_group_size``
  read ahead and written behind (``pipeline_read``/``pipeline_write``);
- ``nvme_serial``: the same with both pipelines off, every read and write waited on at once;
- ``nvme_all``: ZeRO-Infinity proper (stage 3): parameters (``offload_param``) and the
  optimizer on NVMe, the model built under ``zero.Init`` so its shards go to the swap file
  as it is constructed.

``--beyond-ram`` runs ``none`` and ``nvme_all`` on a model sized by ``--n-layer`` /
``--n-embd`` with memory-lean settings (small buckets, no reuse, a low live-parameter
bound) and reports the fp32 parameters + gradients + Adam state per rank (16Ψ/N bytes)
against the peak RSS each rank actually used, and whether the losses agree.

Per mode: the median step time (slowest rank), the optimizer step's share, the peak RSS
(``VmHWM``) per rank, and the bytes of swap files. The fraction of the NVMe IO hidden by
overlap is ``(serial - pipelined) / (serial - cpu)`` of the optimizer-step times: the IO
time a serial walk adds over the in-memory step, and how much of it pipelining removes.

Run: ``z bench offload --dir /path/on/nvme --json``.
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

MODES = ("none", "cpu", "nvme", "nvme_serial", "nvme_all")


def _config(spec: dict[str, Any]) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": spec["stage"], "sub_group_size": spec["sub_group_size"]}
    mode = spec["mode"]
    if mode == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif mode.startswith("nvme"):
        pipe = mode != "nvme_serial"
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": spec["dir"],
            "pipeline_read": pipe,
            "pipeline_write": pipe,
        }
    if mode == "nvme_all":
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": spec["dir"],
            "buffer_count": 4,
            "buffer_size": spec["param_buffer"],
        }
    if spec.get("lean"):  # hold as little as possible in memory at once
        zero.update(
            reduce_bucket_size=4_000_000,
            stage3_prefetch_bucket_size=4_000_000,
            stage3_max_live_parameters=20_000_000,
            stage3_max_reuse_distance=0,
            stage3_param_persistence_threshold=10_000,
        )
    return {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "aio": {"block_size": spec["block_size"], "queue_depth": spec["queue_depth"]},
        "comm_timeout_s": 600,
    }


def _param_buffer(preset: str, n_layer: int | None, n_embd: int | None, world: int) -> int:
    """Elements of one offload_param buffer: the largest parameter's shard (an MLP weight,
    4 n_embd x n_embd, or an embedding, vocab or block_size x n_embd) plus slack."""
    from ztrain.gpt import GPTConfig

    sizes = {k: v for k, v in (("n_layer", n_layer), ("n_embd", n_embd)) if v}
    cfg = GPTConfig.preset(preset, vocab_size=2048, **sizes)
    largest = cfg.n_embd * max(4 * cfg.n_embd, cfg.vocab_size, cfg.block_size)
    return -(-largest // world) + 4096


def _rank_main(spec: dict[str, Any]) -> None:
    rank, world = spec["rank"], spec["world"]
    import torch
    import torch.distributed as dist

    import zcore
    from zcore.zero import Init
    from ztrain.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sizes = {k: spec[k] for k in ("n_layer", "n_embd") if spec.get(k)}
    cfg = GPTConfig.preset(spec["preset"], vocab_size=2048, **sizes)
    config = _config(spec)
    with Init(enabled=spec["stage"] == 3, config=config):
        model = GPT(cfg, seed=0)
    psi = sum(
        getattr(p, "z_numel", p.numel()) for p in {id(p): p for p in model.parameters()}.values()
    )
    engine, *_ = zcore.initialize(model, config=config)
    g = torch.Generator().manual_seed(rank)
    seq = min(spec.get("seq", 256), cfg.block_size)
    tok = torch.randint(
        0, 2048, (spec["warmup"] + spec["steps"], spec["micro_batch"], seq + 1), generator=g
    )
    rows, losses = [], []
    for i in range(len(tok)):
        x, y = tok[i, :, :-1], tok[i, :, 1:]
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(x, y)[1]
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        losses.append(float(loss))
        if i >= spec["warmup"]:
            rows.append({"total": t2 - t0, "step": t2 - t1})
    opt_store = engine.zopt.store
    nvme = opt_store.nvme_bytes() if hasattr(opt_store, "nvme_bytes") else 0
    engine.destroy()
    store = engine.stage3.store if engine.stage3 is not None else None
    if store is not None and hasattr(store, "nvme_bytes"):
        nvme += store.nvme_bytes()
    out = {
        "rows": rows,
        "losses": losses,
        "peak_rss_mb": _ranks.memory_mb()["VmHWM"],
        "nvme_bytes": nvme,
        "optimizer": type(opt_store).__name__,
        "params": psi,
    }
    _ranks.write_result(spec, out)
    dist.destroy_process_group()


def _launch(spec: dict[str, Any], tmp: str) -> list[dict[str, Any]]:
    """Start ``spec["world"]`` fresh ranks for one mode; their results (rank order)."""
    return _ranks.launch(
        __file__, spec["world"], spec, tmp, timeout_s=3600, what=f"mode {spec['mode']}"
    )


def _summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    steps = len(ranks[0]["rows"])
    total = [max(r["rows"][i]["total"] for r in ranks) for i in range(steps)]
    opt = [max(r["rows"][i]["step"] for r in ranks) for i in range(steps)]
    return {
        "optimizer": ranks[0]["optimizer"],
        "median_step_s": statistics.median(total),
        "median_optimizer_step_s": statistics.median(opt),
        "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
        "nvme_bytes_per_rank": [r["nvme_bytes"] for r in ranks],
        "params": ranks[0]["params"],
        "losses": ranks[0]["losses"],
    }


def run(
    world_size: int = 2,
    preset: str = "medium",
    stage: int = 2,
    dir: str | None = None,
    steps: int = 5,
    warmup: int = 2,
    micro_batch: int = 2,
    sub_group_size: int = 4_194_304,
    block_size: int = 1_048_576,
    queue_depth: int = 32,
    modes: str = "none,cpu,nvme,nvme_serial",
    beyond_ram: bool = False,
    n_layer: int | None = None,
    n_embd: int | None = None,
    seq: int = 256,
) -> dict[str, Any]:
    if beyond_ram:
        modes, stage = "none,nvme_all", 3
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = set(chosen) - set(MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}; choose from {list(MODES)}")
    with tempfile.TemporaryDirectory(dir=dir) as swap, tempfile.TemporaryDirectory() as tmp:
        base = {
            "world": world_size,
            "preset": preset,
            "stage": stage,
            "dir": swap,
            "steps": steps,
            "warmup": warmup,
            "micro_batch": micro_batch,
            "sub_group_size": sub_group_size,
            "block_size": block_size,
            "queue_depth": queue_depth,
            "lean": beyond_ram,
            "n_layer": n_layer,
            "n_embd": n_embd,
            "seq": seq,
            "param_buffer": _param_buffer(preset, n_layer, n_embd, world_size),
        }
        results = {m: _summary(_launch({**base, "mode": m}, tmp)) for m in chosen}
    out: dict[str, Any] = {
        "benchmark": "offload",
        "world_size": world_size,
        "preset": preset,
        "stage": stage,
        "swap_dir": dir or tempfile.gettempdir(),
        "sub_group_size": sub_group_size,
        "modes": results,
    }
    if "none" in results:
        base_s = results["none"]["median_step_s"]
        out["step_time_ratio_vs_none"] = {
            m: r["median_step_s"] / base_s for m, r in results.items()
        }
        ref = results["none"]["losses"]
        out["max_abs_loss_diff_vs_none"] = {
            m: max(abs(a - b) for a, b in zip(r["losses"], ref, strict=True))
            for m, r in results.items()
        }
    if "nvme_all" in results:
        r = results["nvme_all"]
        states = 16 * r["params"] / world_size  # fp32 params + grads + Adam m, v per rank
        peak = max(r["peak_rss_mb"]) * 2**20
        out["beyond_ram"] = {
            "params": r["params"],
            "model_state_bytes_per_rank": states,
            "peak_rss_bytes_per_rank": peak,
            "model_states_over_peak_rss": states / peak,
            "swap_bytes_per_rank": max(r["nvme_bytes_per_rank"]),
        }
    if {"cpu", "nvme", "nvme_serial"} <= set(results):
        cpu = results["cpu"]["median_optimizer_step_s"]
        serial = results["nvme_serial"]["median_optimizer_step_s"]
        piped = results["nvme"]["median_optimizer_step_s"]
        io = serial - cpu
        out["nvme_io_hidden_fraction"] = (serial - piped) / io if io > 0 else None
    return out


def report(result: dict[str, Any]) -> str:
    lines = [
        f"offload, {result['preset']} GPT, stage {result['stage']}, "
        f"{result['world_size']} ranks (median step of the slowest rank):"
    ]
    for mode, r in result["modes"].items():
        lines.append(
            f"  {mode:12s} step {r['median_step_s']:.3f}s  optimizer {r['median_optimizer_step_s']:.3f}s"
            f"  peak RSS {max(r['peak_rss_mb']):.0f} MB  swap {max(r['nvme_bytes_per_rank']) / 2**20:.0f} MiB"
        )
    if result.get("nvme_io_hidden_fraction") is not None:
        lines.append(f"  NVMe IO hidden by overlap: {100 * result['nvme_io_hidden_fraction']:.0f}%")
    return "\n".join(lines)


if __name__ == "__main__":  # one rank, started by run() through _ranks.launch
    rank_spec = _ranks.rank_spec(sys.argv)
    if rank_spec is None:
        sys.exit("this file runs as a rank of `z bench offload`; run that instead")
    _rank_main(rank_spec)
