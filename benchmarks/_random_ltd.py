"""`z bench efficiency --sections random_ltd`: random-LTD against the plain model, same run.

Two engines of `z train`'s GPT (the `deep` preset: 12 layers of width 128, where dropping
tokens in 10 middle layers pays; one rank, ZeRO stage 0) start from the same weights and
train on the same Shakespeare batches with `z train`'s default config (AdamW, warm-up +
cosine by step): *plain*, and *random_ltd* with `data_efficiency.data_routing.random_ltd`
on layers 1..10, keeping from an eighth of the tokens (`fixed_linear`) up to all of them at
the last step, as in the random-LTD paper (the first and last layers see every token).
Sequences are 4 x `--seq-len` tokens (random-LTD's savings need long sequences;
attention cost grows with T^2); `--steps`, `--micro-batch`, `--lr` and `--evals` as given.

The two alternate step by step (the order flips each step), so a busy machine slows both
alike; per-step wall-clock is each arm's median. Both see the same tokens, so the
validation losses (the same 4 fixed validation micro-batches at full length, every
`steps / evals` steps) compare at equal tokens. Reported:

- `wall_clock_saved`: 1 - median step time of random_ltd / plain (measured);
- `flops_saved`: 1 - the model FLOPs per step of random_ltd / plain, averaged over the run
  (arithmetic: 3 x forward; per layer and token 24 d^2 for the projections and MLP plus
  4 n d for dense attention over the n tokens the layer sees; LM head 2 d V);
- `val_loss_gap`: (random_ltd - plain) / plain of the final validation loss;
- `gather_scatter`: CPU seconds of one gather+scatter at the run's shape, the flattened
  `index_select`/`index_copy_` that zcore uses against `torch.gather`/`scatter` (why no
  native CPU kernel: see `zcore.data_efficiency.token_routing`).

The done-when target of issue 22 is `wall_clock_saved >= 0.2` with `val_loss_gap <= 0.02`;
`meets_target` says whether this run met it.

Measured runs (date, host, command, numbers): `benchmarks/results/random-ltd.md`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

PRESET = "deep"
LTD_LAYERS = list(range(1, 11))
VAL_BATCHES = 4


def ltd_block(seq_len: int, steps: int) -> dict[str, Any]:
    """The `data_efficiency` block of the random_ltd arm."""
    per_step = 8 if seq_len % 8 == 0 and seq_len >= 64 else 1
    low = max(per_step, seq_len // 8 // per_step * per_step)
    return {
        "enabled": True,
        "data_routing": {
            "enabled": True,
            "random_ltd": {
                "enabled": True,
                "total_layer_num": 12,
                "random_ltd_layer_num": len(LTD_LAYERS),
                "random_ltd_layer_id": LTD_LAYERS,
                "model_mask_name": None,
                "model_type": "decoder",
                "hidden_state_order": "batch_seq_dim",
                "random_ltd_schedule": {
                    "min_value": low,
                    "max_value": seq_len,
                    "schedule_type": "fixed_linear",
                    "schedule_config": {
                        "require_steps": max(1, steps - 1),
                        "seq_per_step": per_step,
                    },
                },
            },
        },
    }


def step_flops(cfg: Any, batch: int, seq_len: int, keep: int) -> float:
    """Model FLOPs of one training step (module docstring); `keep` tokens in LTD_LAYERS."""
    d, v = cfg.n_embd, cfg.vocab_size

    def layer(n: int) -> float:
        return n * 24 * d * d + 4 * n * n * d

    layers = sum(layer(keep if i in LTD_LAYERS else seq_len) for i in range(cfg.n_layer))
    return 3.0 * batch * (layers + 2 * seq_len * d * v)


def gather_scatter_timing(batch: int, seq_len: int, width: int, keep: int) -> dict[str, float]:
    """Median seconds of one gather + scatter (forward only) at this shape, two ways."""
    from zcore.data_efficiency import token_routing as tr

    x = torch.randn(batch, seq_len, width)
    idx = tr.sample_indices(batch, seq_len, keep)

    def median(fn: Any) -> float:
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    with torch.no_grad():
        used = median(lambda: tr.scatter_tokens(x, tr.gather_tokens(x, idx), idx))
        ref = median(lambda: tr.scatter_reference(x, tr.gather_reference(x, idx), idx))
    return {"index_select_copy_s": used, "torch_gather_scatter_s": ref}


def _engines(o: Any, seq_len: int) -> tuple[Any, dict[str, Any], Any, Any]:
    import zcore
    from ztrain.data import ShakespeareData, load_plays
    from ztrain.gpt import GPT
    from ztrain.moe_plan import model_config
    from ztrain.tokenizer import train_or_load
    from ztrain.train_config import default_config
    from ztrain.train_options import TrainOptions, cache_dir

    plays = load_plays()
    tokenizer = train_or_load(cache_dir(), 2048, plays)
    data = ShakespeareData.load(tokenizer, cache_dir(), plays)
    cfg = model_config(PRESET, tokenizer.vocab_size, None)
    opts = TrainOptions(
        preset=PRESET,
        steps=o.steps,
        stage=0,
        micro_batch=o.micro_batch,
        seq_len=seq_len,
        lr=o.lr,
        seed=o.seed,
    )
    base = default_config(opts)
    engines = {}
    for name in ("plain", "random_ltd"):
        config = dict(base)
        if name == "random_ltd":
            config["data_efficiency"] = ltd_block(seq_len, o.steps)
        engines[name], *_ = zcore.initialize(GPT(cfg, seed=o.seed), config=config)
    return cfg, engines, data.stream("train", seq_len, o.seed), data.stream("val", seq_len, o.seed)


def _val_loss(engine: Any, val: Any, mb: int) -> float:
    engine.eval()
    with torch.no_grad():
        total = sum(
            engine(*val.get_micro_batch(i, 0, 0, 1, mb, 1))[1].item() for i in range(VAL_BATCHES)
        )
    engine.train()
    return total / VAL_BATCHES


def random_ltd_section(o: Any) -> dict[str, Any]:
    """Plain vs random-LTD, alternating steps; see the module docstring."""
    seq_len = 4 * o.seq_len
    cfg, engines, train, val = _engines(o, seq_len)
    if seq_len > cfg.block_size:
        raise ValueError(
            f"--seq-len {o.seq_len}: random_ltd trains at 4x it, above {cfg.block_size}"
        )
    eval_every = max(1, o.steps // o.evals)
    times: dict[str, list[float]] = {n: [] for n in engines}
    curve: list[dict[str, Any]] = []
    flops = {"plain": 0.0, "random_ltd": 0.0}
    ltd = engines["random_ltd"].random_ltd
    for step in range(o.steps):
        x, y = train.get_micro_batch(step, 0, 0, 1, o.micro_batch, 1)
        order = list(engines) if step % 2 == 0 else list(reversed(engines))
        for name in order:
            engine = engines[name]
            t0 = time.perf_counter()
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            times[name].append(time.perf_counter() - t0)
        keep = min(ltd.keep, seq_len)
        flops["plain"] += step_flops(cfg, o.micro_batch, seq_len, seq_len)
        flops["random_ltd"] += step_flops(cfg, o.micro_batch, seq_len, keep)
        if (step + 1) % eval_every == 0 or step + 1 == o.steps:
            point = {"step": step + 1, "tokens": (step + 1) * o.micro_batch * seq_len, "keep": keep}
            point.update({n: _val_loss(e, val, o.micro_batch) for n, e in engines.items()})
            curve.append(point)
    for engine in engines.values():
        engine.destroy()
    med = {n: statistics.median(t) for n, t in times.items()}
    final = curve[-1]
    saved = 1 - med["random_ltd"] / med["plain"]
    gap = (final["random_ltd"] - final["plain"]) / final["plain"]
    return {
        "preset": PRESET,
        "n_layer": cfg.n_layer,
        "random_ltd_layers": LTD_LAYERS,
        "seq_len": seq_len,
        "micro_batch": o.micro_batch,
        "steps": o.steps,
        "tokens": final["tokens"],
        "schedule": ltd_block(seq_len, o.steps)["data_routing"]["random_ltd"][
            "random_ltd_schedule"
        ],
        "step_s_median": med,
        "step_s_mean": {n: statistics.fmean(t) for n, t in times.items()},
        "wall_clock_saved": saved,
        "flops_per_step": {n: f / o.steps for n, f in flops.items()},
        "flops_saved": 1 - flops["random_ltd"] / flops["plain"],
        "final_val_loss": {"plain": final["plain"], "random_ltd": final["random_ltd"]},
        "val_loss_gap": gap,
        "meets_target": saved >= 0.2 and gap <= 0.02,
        "curve": curve,
        "gather_scatter": gather_scatter_timing(o.micro_batch, seq_len, cfg.n_embd, seq_len // 2),
    }
