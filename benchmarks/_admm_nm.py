"""ADMM N:M (NxMTransformer) against one-shot magnitude N:M on real models and real text.

For each model, in one run and from the same dense weights:

- `dense`: the unpruned model;
- `magnitude`: one-shot magnitude N:M (`zquant.prune_nm`) of the selected layers;
- `magnitude_finetune`: that fixed mask fine-tuned for as many steps as ADMM takes in total
  (ADMM phase + its masked fine-tune), so the comparison spends equal training;
- `admm`: `zquant.admm_nm.admm_nm_prune` (ADMM phase, hard cut, masked fine-tune).

Models (from `$ZSTACK_MODELS` or `~/.cache/zstack/models`) and objectives:

- all-MiniLM-L6-v2: every Linear of the 6 encoder layers (Q, K, V, attention output,
  intermediate, output); the training loss is 1 - cosine between the sparse and the dense
  model's mean-pooled sentence embeddings on Shakespeare train-play sentences, the metric the
  mean cosine to the dense embeddings on held-out-play sentences (higher is better).
- SmolLM2-135M-Instruct: the MLP Linears (gate, up, down) of the last `smol_layers` decoder
  layers; the training loss is the normalized MSE between the sparse and the dense model's
  final (normed) hidden state on train-play windows (it feeds the LM head linearly; layers
  0..25 are frozen and unpruned, so their output is computed once and training runs only the
  last layers), the metric held-out-play perplexity (lower is better).

Only the selected weights train; the rest is frozen (see `zquant.admm_nm`).

Measured runs (date, host, command, numbers): `benchmarks/results/admm-nm.md`.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

MINILM = "all-MiniLM-L6-v2"
SMOLLM = "SmolLM2-135M-Instruct"
MINILM_MODULES = [
    r"re:encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)"
]


def _model_dir(name: str) -> Path:
    root = Path(os.environ.get("ZSTACK_MODELS", Path.home() / ".cache" / "zstack" / "models"))
    path = root / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model `{name}` not found at `{path}`; run `make setup`")
    return path


def _plays() -> tuple[str, str]:
    from ztrain.data import load_plays, split_plays

    train, val = split_plays(load_plays())
    return "\n".join(t for _, t in train), "\n".join(t for _, t in val)


def _pooled(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean-pooled last hidden state (padding masked), differentiable; (B, H)."""
    hidden = model(**batch).last_hidden_state  # (B, T, H)
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def _variants(
    dense: torch.nn.Module, loss_fn: Any, batches: list[Any], cfg: Any, metric: Any
) -> dict[str, Any]:
    """The four numbers of one model: dense, magnitude, magnitude + fine-tune, ADMM."""
    from zquant.admm_nm import admm_nm_prune, magnitude_nm, masked_finetune
    from zquant.pruning import sparsity

    out: dict[str, Any] = {}
    t = time.perf_counter()
    out["dense"] = metric(dense)
    mag = copy.deepcopy(dense)
    masks = magnitude_nm(mag, cfg)
    out["magnitude"] = metric(mag)
    t0 = time.perf_counter()
    masked_finetune(mag, masks, loss_fn, batches, cfg.steps + cfg.finetune_steps, cfg.lr)
    out["magnitude_finetune_s"] = round(time.perf_counter() - t0, 1)
    out["magnitude_finetune"] = metric(mag)
    del mag
    admm = copy.deepcopy(dense)
    t0 = time.perf_counter()
    result = admm_nm_prune(admm, loss_fn, batches, cfg)
    out["admm_s"] = round(time.perf_counter() - t0, 1)
    out["admm"] = metric(admm)
    modules = dict(admm.named_modules())
    out["layers"] = len(result.masks)
    out["layer_sparsity"] = round(
        sum(sparsity(modules[k]) for k in result.masks) / len(result.masks), 4
    )
    out["admm_residuals"] = [round(r, 4) for r in result.residuals]
    with torch.no_grad():
        flips = sum(float((pm.mask != masks[k].mask).sum()) for k, pm in result.masks.items())
        total = sum(pm.mask.numel() for pm in result.masks.values())
    out["mask_diff_vs_magnitude"] = round(flips / total, 4)
    out["wall_s"] = round(time.perf_counter() - t, 1)
    return out


def _minilm(cfg: Any, train_n: int, eval_n: int, batch: int) -> dict[str, Any]:
    from zquant.hf import load_model, load_tokenizer
    from zquant.metrics import embedding_similarity, sentence_embeddings, sentences_from_text

    train_text, val_text = _plays()
    path = _model_dir(MINILM)
    tok = load_tokenizer(path)
    dense = load_model(path)
    train = sentences_from_text(train_text, limit=train_n)
    held = sentences_from_text(val_text, limit=eval_n)
    reference = sentence_embeddings(dense, tok, held)
    batches = []
    for i in range(0, len(train), batch):
        enc = tok(
            train[i : i + batch], padding=True, truncation=True, max_length=32, return_tensors="pt"
        )
        enc = dict(enc)
        with torch.no_grad():
            target = _pooled(dense, enc)
        batches.append((enc, target))

    def loss_fn(model: torch.nn.Module, b: Any) -> torch.Tensor:
        enc, target = b
        return 1.0 - F.cosine_similarity(_pooled(model, enc), target, dim=-1).mean()

    def metric(model: torch.nn.Module) -> float:
        return round(embedding_similarity(model, tok, held, reference), 5)

    out = _variants(dense, loss_fn, batches, cfg, metric)
    out.update(
        metric_name="mean cosine to dense embeddings (higher is better)",
        train_sentences=len(train),
        eval_sentences=len(held),
        batch=batch,
    )
    return out


def _tail_batches(
    dense: torch.nn.Module, windows: torch.Tensor, first: int, batch: int
) -> list[Any]:
    """(input of layer `first`, its call kwargs, dense final-norm output) per batch.

    The layers before `first` are frozen and unpruned, so their output is computed once;
    training then runs only layers `first..` and the final norm (about 8x cheaper here).
    """
    inner = dense.model
    captured: dict[str, Any] = {}

    def pre(_mod: Any, args: tuple, kwargs: dict) -> None:
        captured["h"] = args[0] if args else kwargs["hidden_states"]
        captured["kw"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}

    def post(_mod: Any, _args: Any, out: torch.Tensor) -> None:
        captured["target"] = out

    hooks = [
        inner.layers[first].register_forward_pre_hook(pre, with_kwargs=True),
        inner.norm.register_forward_hook(post),
    ]
    out = []
    try:
        with torch.no_grad():
            for i in range(0, windows.shape[0], batch):
                inner(input_ids=windows[i : i + batch], use_cache=False)
                out.append((captured["h"], captured["kw"], captured["target"]))
    finally:
        for h in hooks:
            h.remove()
    return out


def _smollm(
    cfg: Any, first: int, train_windows: int, window: int, batch: int, eval_tokens: int
) -> dict[str, Any]:
    from zquant.hf import load_model, load_tokenizer
    from zquant.metrics import perplexity

    train_text, val_text = _plays()
    path = _model_dir(SMOLLM)
    tok = load_tokenizer(path)
    dense = load_model(path)
    ids = tok(
        train_text[: train_windows * window * 8], return_tensors="pt", add_special_tokens=False
    )["input_ids"][0]
    n = min(train_windows, len(ids) // window)
    windows = ids[: n * window].view(n, window)  # (n, window)
    batches = _tail_batches(dense, windows, first, batch)

    def loss_fn(model: torch.nn.Module, b: Any) -> torch.Tensor:
        """Distillation of the final (normed) hidden state, which feeds the LM head linearly."""
        h, kw, target = b
        for layer in model.model.layers[first:]:
            h = layer(h, **kw)
            h = h[0] if isinstance(h, tuple) else h
        h = model.model.norm(h)
        return (h - target).pow(2).mean() / target.pow(2).mean()

    def metric(model: torch.nn.Module) -> float:
        return round(perplexity(model, tok, val_text, max_tokens=eval_tokens, window=window), 3)

    out = _variants(dense, loss_fn, batches, cfg, metric)
    out.update(
        metric_name="held-out perplexity (lower is better)",
        train_windows=n,
        window=window,
        batch=batch,
        eval_tokens=eval_tokens,
        loss="normalized MSE to the dense final hidden state",
    )
    return out


def admm_section(
    steps: int = 30,
    *,
    finetune_steps: int = 10,
    models: tuple[str, ...] = ("minilm", "smollm2"),
    n: int = 2,
    m: int = 4,
    admm_interval: int = 5,
    rho: float = 200.0,
    rho_growth: float = 1.5,
    rho_max: float = 3000.0,
    penalty: str = "decoupled",
    minilm_lr: float = 1e-4,
    smol_lr: float = 1e-4,
    smol_layers: int = 4,
    minilm_train: int = 96,
    minilm_eval: int = 128,
    minilm_batch: int = 16,
    smol_train_windows: int = 16,
    smol_window: int = 128,
    smol_batch: int = 4,
    smol_eval_tokens: int = 1024,
    seed: int = 0,
    torch_threads: int = 1,
) -> dict[str, Any]:
    """ADMM N:M vs magnitude N:M (one-shot and + equal fine-tune) on MiniLM and SmolLM2.

    `steps` ADMM steps plus `finetune_steps` masked steps; the magnitude baseline gets
    `steps + finetune_steps` masked steps. Returns one JSON-able dict: `settings`, then per
    model `dense`, `magnitude`, `magnitude_finetune`, `admm` (the metric), timings, the
    fraction of mask entries where ADMM's mask differs from magnitude's, and whether ADMM
    beats each baseline. `torch_threads` is set for the run and restored (one thread: on a
    shared, loaded 2-core CPU two spinning OpenMP threads ran ~7x slower).
    """
    from zquant.admm_nm import ADMMConfig

    base = dict(
        steps=steps,
        finetune_steps=finetune_steps,
        n=n,
        m=m,
        admm_interval=admm_interval,
        rho=rho,
        rho_growth=rho_growth,
        rho_max=rho_max,
        penalty=penalty,
    )
    out: dict[str, Any] = {"settings": dict(base, seed=seed, torch_threads=torch_threads)}
    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    t = time.perf_counter()
    try:
        for name in models:
            torch.manual_seed(seed)
            if name == "minilm":
                cfg = ADMMConfig(modules=MINILM_MODULES, lr=minilm_lr, **base)
                out["minilm"] = _minilm(cfg, minilm_train, minilm_eval, minilm_batch)
                out["minilm"]["modules"] = MINILM_MODULES
            elif name == "smollm2":
                first = 30 - smol_layers
                layers = "|".join(str(i) for i in range(first, 30))
                pattern = rf"re:model\.layers\.({layers})\.mlp\.(gate|up|down)_proj"
                cfg = ADMMConfig(modules=[pattern], lr=smol_lr, **base)
                out["smollm2"] = _smollm(
                    cfg, first, smol_train_windows, smol_window, smol_batch, smol_eval_tokens
                )
                out["smollm2"]["modules"] = [pattern]
            else:
                raise ValueError(f"models: unknown {name!r}; use 'minilm' and/or 'smollm2'")
    finally:
        torch.set_num_threads(threads)
    for key, sign in (("minilm", 1.0), ("smollm2", -1.0)):
        if key in out:
            r = out[key]
            r["admm_beats_magnitude"] = sign * (r["admm"] - r["magnitude"]) > 0
            r["admm_beats_magnitude_finetune"] = sign * (r["admm"] - r["magnitude_finetune"]) > 0
    out["wall_s"] = round(time.perf_counter() - t, 1)
    return out


if __name__ == "__main__":  # pragma: no cover - manual run
    import json
    import sys

    print(json.dumps(admm_section(*(int(a) for a in sys.argv[1:2])), indent=1))
