"""zcore.hf.Trainer against transformers' Trainer on DDP, the same fine-tune.

For each mode (full fine-tuning at ZeRO-2 and ZeRO-3, LoRA at ZeRO-3) the same model, data,
TrainingArguments and seed run on N gloo ranks twice in this call: under ``zcore.hf.Trainer``
and under the baseline, transformers' Trainer without a ZeRO config (DDP through accelerate).
Issue 47 names transformers' DeepSpeed Trainer as the baseline; DeepSpeed is not installed
here, so the result records its import error (``deepspeed_unavailable``) and a DeepSpeed rank
path is not built. Each rank is a fresh interpreter; reported per mode: the
median step time after ``warmup`` steps (rank 0's ``on_step_begin`` → ``on_step_end``) and
the peak RSS of the largest rank, with the ratios zcore / baseline (issue 47's targets:
step ≤ 0.9x, RSS ≤ 1x).

Run: ``z bench hf-trainer --json`` (default: the SmolLM2-135M directory under
``~/.cache/zstack/models``, 2 ranks); ``--model tiny`` writes a 2-layer random LLaMA instead.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from zcore.bench import load

_ranks = load("_ranks", Path(__file__).parent)

SMOLLM2 = Path.home() / ".cache/zstack/models/SmolLM2-135M-Instruct"
MODES = {"zero2": (2, False), "zero3": (3, False), "lora3": (3, True)}
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def _rank(spec: dict[str, Any]) -> None:
    """One rank (started by :func:`run` through ``_ranks.launch``): one mode, one engine."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo", rank=spec["rank"], world_size=spec["world"])
    from transformers import LlamaForCausalLM, TrainerCallback, TrainingArguments

    stage, lora = MODES[spec["mode"]]
    steps = spec["warmup"] + spec["steps"]
    args = TrainingArguments(
        output_dir=spec["work"],
        per_device_train_batch_size=spec["micro_batch"],
        max_steps=steps,
        learning_rate=1e-5,
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_drop_last=True,
        seed=0,
    )
    config = {"zero_optimization": {"stage": stage}, "comm_timeout_s": 600}
    torch.manual_seed(0)
    if spec["engine"] == "zcore" and stage == 3:
        import zcore.hf

        hidden = json.loads((Path(spec["model"]) / "config.json").read_text())["hidden_size"]
        init = zcore.hf.init_config(config, args, hidden_size=hidden)
        model = zcore.hf.from_pretrained(LlamaForCausalLM, spec["model"], ds_config=init)
    else:
        model = LlamaForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    rows = spec["micro_batch"] * spec["world"] * steps
    ids = torch.randint(0, vocab, (rows, spec["seq"]), generator=g)
    data = [{"input_ids": r, "labels": r.clone()} for r in ids]

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            times.append(time.perf_counter() - self.start)

    kwargs = dict(model=model, args=args, train_dataset=data, callbacks=[StepTimer()])
    if spec["engine"] == "zcore":
        import zcore.hf

        trainer = zcore.hf.Trainer(**kwargs, config=config)
    else:
        from transformers import Trainer

        trainer = Trainer(**kwargs)  # DDP through accelerate (or DeepSpeed, see run())
    trainer.train()
    _ranks.write_result(
        spec,
        {"step_s": statistics.median(times[spec["warmup"] :]), "rss": _ranks.memory_mb()},
    )


def _deepspeed_error() -> str | None:
    """Why transformers' DeepSpeed Trainer cannot be the baseline here (None: it can)."""
    try:
        import deepspeed  # noqa: F401
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "deepspeed imports, but this benchmark has no DeepSpeed rank path yet"


def run(
    model: str = str(SMOLLM2),
    world_size: int = 2,
    modes: str = "zero2,zero3,lora3",
    steps: int = 5,
    warmup: int = 2,
    micro_batch: int = 2,
    seq: int = 128,
    threads: int = 1,
) -> dict[str, Any]:
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in chosen if m not in MODES]
    if bad:
        raise ValueError(f"--modes {modes!r}: {bad} unknown; choose from {sorted(MODES)}")
    deepspeed = _deepspeed_error()
    baseline = "ddp"  # transformers' Trainer without a ZeRO config
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if model == "tiny":
            model = str(_tiny(Path(tmp) / "tiny"))
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"--model {model!r} has no config.json; fetch the models first")
        for mode in chosen:
            row: dict[str, Any] = {}
            for engine in ("zcore", baseline):
                spec = dict(
                    mode=mode,
                    engine=engine,
                    model=model,
                    steps=steps,
                    warmup=warmup,
                    micro_batch=micro_batch,
                    seq=seq,
                    threads=threads,
                    work=f"{tmp}/{mode}-{engine}",
                )
                ranks = _ranks.launch(
                    __file__, world_size, spec, tmp, timeout_s=3600, what=f"hf-trainer {mode}"
                )
                row[engine] = {
                    "step_s": ranks[0]["step_s"],
                    "peak_rss_mb": max(r["rss"].get("VmHWM", 0.0) for r in ranks),
                }
            row["step_ratio"] = row["zcore"]["step_s"] / row[baseline]["step_s"]
            row["rss_ratio"] = row["zcore"]["peak_rss_mb"] / row[baseline]["peak_rss_mb"]
            results[mode] = row
    return {
        "benchmark": "hf_trainer",
        "model": model,
        "world_size": world_size,
        "steps": steps,
        "warmup": warmup,
        "micro_batch": micro_batch,
        "seq": seq,
        "baseline": baseline,
        "deepspeed_unavailable": deepspeed,
        "modes": results,
        "targets": {"step_ratio_max": 0.9, "rss_ratio_max": 1.0},
    }


def _tiny(out: Path) -> Path:
    """A 2-layer random LLaMA written by transformers (for a quick run of the benchmark)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def report(result: dict[str, Any]) -> str:
    base = result["baseline"]
    lines = [
        f"HF Trainer fine-tune: {result['model']}, {result['world_size']} ranks, "
        f"micro-batch {result['micro_batch']} x {result['seq']} tokens, median of "
        f"{result['steps']} steps after {result['warmup']}; baseline: transformers' Trainer "
        f"with {base.upper()}"
        + (
            f" (DeepSpeed: {result['deepspeed_unavailable']})"
            if result["deepspeed_unavailable"]
            else ""
        ),
        "mode     zcore s/step   base s/step   ratio   zcore RSS MB   base RSS MB   ratio",
    ]
    for mode, r in result["modes"].items():
        z, b = r["zcore"], r[base]
        lines.append(
            f"{mode:<8} {z['step_s']:12.3f} {b['step_s']:13.3f} {r['step_ratio']:7.2f} "
            f"{z['peak_rss_mb']:14.0f} {b['peak_rss_mb']:13.0f} {r['rss_ratio']:7.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # one rank, started by run() through _ranks.launch
    spec = _ranks.rank_spec(sys.argv)
    if spec is None:
        sys.exit("this file runs as a rank of `z bench hf-trainer`; run that instead")
    _rank(spec)
