"""MoE layer throughput: forward+backward tokens/s of ``zmoe.MoE`` (capacity and dropless
paths) next to a dense MLP of equal active parameters and DeepSpeed's own MoE layer
(``deepspeed.moe.layer.MoE`` at ``ep_size=1``, capacity and ``drop_tokens=False``).

Every MoE contender has the same gate and expert weights (DeepSpeed's, loaded into ours by
name) and routes the same tokens deterministically (``use_rts=False``,
``top2_2nd_expert_sampling=False``, so both layers pick the same experts and drop the same
routes); the dense MLP is ``Linear(d, k*ffn)``, GELU, ``Linear(k*ffn, d)``. One timed
sample is one training step of one contender: ``out, l_aux = layer(x)``, backward of
``sum(out * w) + l_aux``, gradients cleared. The contenders take turns within each repeat
(the order rotating every repeat), so load from other processes hits them alike; medians
are reported, and each ratio is the median over repeats of that repeat's pair.

All-to-all bytes at ``ep=2`` are computed, not measured over gloo: the tokens are cut in two
halves (rank 0's and rank 1's), our layer routes each half at ``ep_size=1``, and the bytes
are what ``MoEStats.dispatch_bytes`` / ``combine_bytes`` count at ``ep_size=2`` for those
routes (dropless: kept routes x d x element size; capacity: E x C x d x element size, C
from the half's token count). ``off_rank`` counts only the rows bound for the other rank.

Run: ``z bench moe --json`` (DeepSpeed columns need ``PYTHONPATH`` to hold DeepSpeed, as
``make bench-deepspeed`` sets it).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
from torch import nn

import zmoe

NOT_IMPORTABLE = "not importable"
RATIOS = {
    "dropless_vs_ds_capacity": ("dropless", "ds_capacity"),
    "dropless_vs_ds_dropless": ("dropless", "ds_dropless"),
    "dropless_vs_dense": ("dropless", "dense"),
    "capacity_vs_ds_capacity": ("capacity", "ds_capacity"),
}
TARGETS = {
    "dropless_vs_ds_capacity": 1.2,
    "dropless_vs_ds_dropless": 1.0,
    "dropless_vs_dense": 1.0,
    "capacity_vs_ds_capacity": 1.0,
}


def _mlp(d: int, ffn: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d))


def _deepspeed_layer() -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else its detection logs to stdout
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            from deepspeed.moe.layer import MoE as DeepSpeedMoE
    except Exception:  # any failure to import means no DeepSpeed column
        return None
    return DeepSpeedMoE


def _layers(
    d: int, ffn: int, experts: int, k: int, factor: float, with_ds: bool
) -> tuple[dict[str, nn.Module], str | None]:
    common = {
        "num_experts": experts,
        "k": k,
        "capacity_factor": factor,
        "use_rts": False,
        "top2_2nd_expert_sampling": False,
    }
    torch.manual_seed(0)
    ds_cls = _deepspeed_layer() if with_ds else None
    layers: dict[str, nn.Module] = {"dense": _mlp(d, k * ffn)}
    reference = zmoe.MoE(d, _mlp(d, ffn), **common)
    for expert in reference.experts.values():  # distinct experts
        for p in expert.parameters():
            nn.init.normal_(p, 0.0, 0.02)
    state = reference.state_dict()
    for name, drop in (("capacity", True), ("dropless", False)):
        layers[name] = zmoe.MoE(d, _mlp(d, ffn), drop_tokens=drop, **common)
        layers[name].load_state_dict(state)
    if ds_cls is None:
        return layers, (NOT_IMPORTABLE if with_ds else "skipped (--no-ds)")
    ds_state = {
        n.replace("gate.", "deepspeed_moe.gate.", 1).replace(
            "experts.", "deepspeed_moe.experts.deepspeed_experts.", 1
        ): v
        for n, v in state.items()
    }
    for name, drop in (("ds_capacity", True), ("ds_dropless", False)):
        layers[name] = ds_cls(d, _mlp(d, ffn), drop_tokens=drop, **common)
        layers[name].load_state_dict(ds_state)
    return layers, None


def _step(layer: nn.Module, x: torch.Tensor, w: torch.Tensor) -> float:
    start = time.perf_counter()
    xi = x.clone().requires_grad_()
    out = layer(xi)
    if isinstance(out, tuple):
        loss = (out[0] * w).sum() + out[1]
    else:
        loss = (out * w).sum()
    loss.backward()
    for p in layer.parameters():
        p.grad = None
    return time.perf_counter() - start


def _routing_stats(layer: zmoe.MoE, x: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        layer(x)
    stats = layer.last_stats
    assert stats is not None
    load = stats.expert_load.double()
    cv = float(load.std(unbiased=False) / load.mean()) if float(load.mean()) else 0.0
    return {
        "dropped_fraction": stats.dropped_fraction,
        "expert_load_cv": cv,
        "capacity": stats.capacity,
    }


def _ep2_bytes(layer: zmoe.MoE, x: torch.Tensor) -> dict[str, Any]:
    """All-to-all bytes per layer per rank at ep=2, computed from each half's routing."""
    es, d, e = x.element_size(), x.shape[1], layer.num_experts
    ranks = []
    with torch.no_grad():
        for rank, half in enumerate(x.chunk(2)):
            layer(half)
            stats = layer.last_stats
            assert stats is not None
            load = stats.expert_load
            other = load.view(2, -1)[1 - rank].sum()
            if stats.capacity:  # the padded [E, C, d] buffer goes out and comes back
                sent = e * stats.capacity * d * es
                off_rank = e // 2 * stats.capacity * d * es
            else:
                sent = int(load.sum()) * d * es
                off_rank = int(other) * d * es
            ranks.append(
                {"dispatch_bytes": sent, "combine_bytes": sent, "off_rank_bytes": 2 * off_rank}
            )
    return {
        "method": "computed for a 2-way split of the same tokens (ep_size=1 routing)",
        "per_rank": ranks,
        "per_layer_total": sum(r["dispatch_bytes"] + r["combine_bytes"] for r in ranks),
    }


def run(
    tokens: int = 4096,
    d_model: int = 256,
    ffn: int = 1024,
    experts: int = 8,
    k: int = 2,
    capacity_factor: float = 1.25,
    threads: int = 2,
    repeats: int = 9,
    warmup: int = 1,
    deepspeed: bool = True,
) -> dict[str, Any]:
    if tokens < 2 or d_model < 1 or ffn < 1 or experts < 2 or not 1 <= k <= experts:
        raise ValueError(
            f"tokens {tokens} (>= 2), d_model {d_model}, ffn {ffn}, experts {experts} (>= 2) "
            f"and k {k} (1..experts) are out of range"
        )
    if experts % 2:
        raise ValueError(f"experts {experts} must be even (the ep=2 byte count splits them)")
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    layers, ds_missing = _layers(d_model, ffn, experts, k, capacity_factor, deepspeed)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, d_model, generator=gen)
    w = torch.randn(tokens, d_model, generator=gen)
    names = list(layers)
    for _ in range(warmup):
        for name in names:
            _step(layers[name], x, w)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(tokens / _step(layers[name], x, w))
    results: dict[str, Any] = {
        name: {"tokens_per_s": statistics.median(s), "samples": [round(v) for v in s]}
        for name, s in samples.items()
    }
    for name in ("ds_capacity", "ds_dropless"):
        if name not in results:
            results[name] = {"tokens_per_s": None, "status": ds_missing}
    for name in ("capacity", "dropless"):
        layer = layers[name]
        assert isinstance(layer, zmoe.MoE)
        results[name].update(_routing_stats(layer, x))
        results[name]["all_to_all_ep2"] = _ep2_bytes(layer, x)
    ratios: dict[str, float | None] = {}
    for key, (ours, theirs) in RATIOS.items():
        if theirs in samples:
            pairs = [a / b for a, b in zip(samples[ours], samples[theirs], strict=True)]
            ratios[key] = round(statistics.median(pairs), 3)
        else:
            ratios[key] = None
    return {
        "benchmark": "moe",
        "sizes": {
            "tokens": tokens,
            "d_model": d_model,
            "ffn": ffn,
            "experts": experts,
            "k": k,
            "capacity_factor": capacity_factor,
            "dtype": "fp32",
            "threads": threads,
            "repeats": repeats,
        },
        "loadavg": {"before": list(load_before), "after": list(os.getloadavg())},
        "results": results,
        "targets": TARGETS,
        "ratios": ratios,
    }


def report(result: dict[str, Any]) -> str:
    s = result["sizes"]
    lines = [
        f"MoE fwd+bwd, T={s['tokens']} d={s['d_model']} ffn={s['ffn']} E={s['experts']} "
        f"k={s['k']} cf={s['capacity_factor']} fp32, {s['threads']} threads, "
        f"{s['repeats']} interleaved repeats (load {result['loadavg']['before'][0]:.2f} -> "
        f"{result['loadavg']['after'][0]:.2f})",
        f"{'contender':<14}{'tokens/s':>12}  notes",
    ]
    for name, r in result["results"].items():
        if r["tokens_per_s"] is None:
            lines.append(f"{name:<14}{'-':>12}  {r['status']}")
            continue
        notes = ""
        if "dropped_fraction" in r:
            a2a = r["all_to_all_ep2"]["per_layer_total"]
            notes = (
                f"dropped {r['dropped_fraction']:.3f}, load cv {r['expert_load_cv']:.3f}, "
                f"ep=2 all-to-all {a2a / 2**20:.1f} MiB/layer"
            )
        lines.append(f"{name:<14}{r['tokens_per_s']:>12.0f}  {notes}")
    for key, value in result["ratios"].items():
        target = result["targets"][key]
        shown = "-" if value is None else f"{value:.2f}x"
        lines.append(f"{key:<26}{shown:>8}  (target >= {target}x)")
    return "\n".join(lines)
