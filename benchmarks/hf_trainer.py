"""zcore.hf.Trainer against transformers' Trainer with DeepSpeed, and on DDP: the same fine-tune.

For each mode (full fine-tuning at ZeRO-2 and ZeRO-3, LoRA at ZeRO-3) the same model, data,
TrainingArguments and seed run on N gloo ranks under each engine in this call:
``zcore.hf.Trainer`` with the ZeRO config as ``config=``; transformers' Trainer with the same
stage as ``TrainingArguments(deepspeed=...)`` (DeepSpeed on its CPU accelerator, over gloo),
when ``deepspeed`` is importable (``make bench-deepspeed`` installs it beside and runs this);
and transformers' Trainer without a ZeRO config (DDP through accelerate). A DeepSpeed run
that fails records its ranks' last log lines in ``deepspeed_errors`` and the comparison
falls back to DDP for that mode. Each rank is a fresh interpreter; reported per mode and
engine: the median step time after ``warmup`` steps (rank 0's ``on_step_begin`` →
``on_step_end``) and the peak RSS of the largest rank, with the ratios zcore / engine
(``vs_deepspeed``, ``vs_ddp``; ``step_ratio``/``rss_ratio`` against the mode's ``baseline``,
DeepSpeed where it ran; issue 47's targets: step ≤ 0.9x, RSS ≤ 1x). The 1-minute load
average is recorded (``load_average``): on a shared machine the times move with it.

Run: ``z bench hf-trainer --json`` (default: the SmolLM2-135M directory under
``~/.cache/zstack/models``, 2 ranks); ``--model tiny`` writes a 2-layer random LLaMA instead.
"""

from __future__ import annotations

import json
import os
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
DS_NOTE = (
    "on DeepSpeed's CPU accelerator transformers' TrainingArguments.world_size reads 1, so "
    "its Trainer does not shard the rows over the ranks (each rank reads the same rows); every "
    "rank's micro-batch (rows x tokens) and the ZeRO stage are as in the other engines, so step "
    "time and memory compare, the losses do not"
)
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def _rank(spec: dict[str, Any]) -> None:
    """One rank (started by :func:`run` through ``_ranks.launch``): one mode, one engine."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    deepspeed = spec["engine"] == "deepspeed"
    if deepspeed:  # DeepSpeed's own process-group set-up, on gloo (DS_ACCELERATOR=cpu)
        import deepspeed as ds  # type: ignore[import-not-found]

        ds.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo", rank=spec["rank"], world_size=spec["world"])
    from transformers import LlamaForCausalLM, TrainerCallback, TrainingArguments

    stage, lora = MODES[spec["mode"]]
    steps = spec["warmup"] + spec["steps"]
    config: dict[str, Any] = {"zero_optimization": {"stage": stage}}
    if deepspeed:  # as a DeepSpeed user writes it for the Trainer
        # (no train_batch_size: on DeepSpeed's CPU accelerator TrainingArguments.world_size
        # reads 1, so "auto" would fill micro x 1; DeepSpeed derives it from its own group)
        config.update(
            train_micro_batch_size_per_gpu="auto",
            gradient_accumulation_steps="auto",
            gradient_clipping="auto",
        )
    else:
        config["comm_timeout_s"] = 600
    args = TrainingArguments(
        output_dir=spec["work"],
        per_device_train_batch_size=spec["micro_batch"],
        max_steps=steps,
        learning_rate=1e-5,
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        # accelerate's CPU path ignores deepspeed=; without CUDA DeepSpeed runs on its CPU
        # accelerator, over the gloo group made above
        use_cpu=not deepspeed,
        ddp_backend="gloo",
        deepspeed=config if deepspeed else None,
        disable_tqdm=True,
        dataloader_drop_last=True,
        seed=0,
    )
    torch.manual_seed(0)  # at DeepSpeed's stage 3 from_pretrained builds under its zero.Init
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
    # resident memory (VmRSS) at each phase: where a peak RSS difference comes from
    phases = {"model_loaded": _ranks.memory_mb().get("VmRSS", 0.0)}

    class StepTimer(TrainerCallback):
        def on_train_begin(self, *a: Any, **kw: Any) -> None:  # the engine is built
            phases["engine_built"] = _ranks.memory_mb().get("VmRSS", 0.0)

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            times.append(time.perf_counter() - self.start)
            phases.setdefault("after_step_1", _ranks.memory_mb().get("VmRSS", 0.0))

    kwargs = dict(model=model, args=args, train_dataset=data, callbacks=[StepTimer()])
    if spec["engine"] == "zcore":
        import zcore.hf

        trainer = zcore.hf.Trainer(**kwargs, config=config)
    else:
        from transformers import Trainer

        trainer = Trainer(**kwargs)  # DDP through accelerate, or DeepSpeed with deepspeed=
    trainer.train()
    _ranks.write_result(
        spec,
        {
            "step_s": statistics.median(times[spec["warmup"] :]),
            "rss": _ranks.memory_mb(),
            "rss_phases_mb": phases,
        },
    )


def _deepspeed_missing() -> str | None:
    """Why DeepSpeed cannot run here (None: ``deepspeed`` is on the path; not imported here)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return (
            "ModuleNotFoundError: No module named 'deepspeed' (install it beside with "
            "`make bench-deepspeed`, which runs this benchmark with it on PYTHONPATH)"
        )
    return None


def _measure(engine: str, mode: str, tmp: str, env: dict[str, str], opt: dict) -> dict:
    """One engine, one mode, on fresh ranks: rank 0's median step and the largest peak RSS."""
    spec = dict(mode=mode, engine=engine, work=f"{tmp}/{mode}-{engine}", **opt)
    what = f"hf-trainer {mode} {engine}"
    ranks = _ranks.launch(__file__, opt["world"], spec, tmp, timeout_s=3600, what=what, env=env)
    return {
        "step_s": ranks[0]["step_s"],
        "peak_rss_mb": max(r["rss"].get("VmHWM", 0.0) for r in ranks),
        "rss_phases_mb": ranks[0].get("rss_phases_mb", {}),
    }


def _ratios(row: dict[str, Any], base: str) -> dict[str, float]:
    return {
        "step_ratio": row["zcore"]["step_s"] / row[base]["step_s"],
        "rss_ratio": row["zcore"]["peak_rss_mb"] / row[base]["peak_rss_mb"],
    }


def run(
    model: str = str(SMOLLM2),
    world_size: int = 2,
    modes: str = "zero2,zero3,lora3",
    steps: int = 5,
    warmup: int = 2,
    micro_batch: int = 2,
    seq: int = 128,
    threads: int = 1,
    deepspeed: bool = True,
) -> dict[str, Any]:
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in chosen if m not in MODES]
    if bad:
        raise ValueError(f"--modes {modes!r}: {bad} unknown; choose from {sorted(MODES)}")
    missing = _deepspeed_missing() if deepspeed else "disabled (run(deepspeed=False))"
    engines = ["zcore", "ddp"] + ([] if missing else ["deepspeed"])
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, no CUDA here
    # DeepSpeed JIT-builds its CPU ops with the interpreter's venv tools (ninja)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if model == "tiny":
            model = str(_tiny(Path(tmp) / "tiny"))
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"--model {model!r} has no config.json; fetch the models first")
        opt = dict(
            model=model,
            steps=steps,
            warmup=warmup,
            micro_batch=micro_batch,
            seq=seq,
            threads=threads,
            world=world_size,
        )
        for mode in chosen:
            row: dict[str, Any] = {}
            for engine in engines:
                try:
                    row[engine] = _measure(engine, mode, tmp, env, opt)
                except RuntimeError as err:
                    if engine != "deepspeed":
                        raise
                    errors[mode] = str(err)[-4000:]  # the failed ranks' last log lines
            row["vs_ddp"] = _ratios(row, "ddp")
            if "deepspeed" in row:
                row["vs_deepspeed"] = _ratios(row, "deepspeed")
            row["baseline"] = "deepspeed" if "deepspeed" in row else "ddp"
            row.update(row[f"vs_{row['baseline']}"])
            results[mode] = row
    ran = all(r["baseline"] == "deepspeed" for r in results.values())
    return {
        "benchmark": "hf_trainer",
        "model": model,
        "world_size": world_size,
        "steps": steps,
        "warmup": warmup,
        "micro_batch": micro_batch,
        "seq": seq,
        "baseline": "deepspeed" if results and ran else "ddp",
        "deepspeed_unavailable": missing,
        "deepspeed_errors": errors,
        "deepspeed_note": None if missing else DS_NOTE,
        "load_average": os.getloadavg(),
        "modes": results,
        "targets": {"step_ratio_max": 0.9, "rss_ratio_max": 1.0},
    }


def _tiny(out: Path) -> Path:
    """A 2-layer random LLaMA (for a quick run of the benchmark), written with safetensors
    alone: this process never imports transformers (only the ranks do)."""
    from safetensors.torch import save_file

    from zcore.hf.random_llama import random_llama

    config, state = random_llama(
        vocab=256, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, std=0.02, max_positions=512
    )
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def report(result: dict[str, Any]) -> str:
    ds = result["deepspeed_unavailable"]
    lines = [
        f"HF Trainer fine-tune: {result['model']}, {result['world_size']} ranks, "
        f"micro-batch {result['micro_batch']} x {result['seq']} tokens, median of "
        f"{result['steps']} steps after {result['warmup']}; load average "
        f"{result['load_average'][0]:.1f}" + (f"; DeepSpeed: {ds}" if ds else ""),
        "mode     engine      s/step   peak RSS MB   zcore step ratio   zcore RSS ratio",
    ]
    for mode, r in result["modes"].items():
        for engine in ("zcore", "ddp", "deepspeed"):
            if engine not in r:
                continue
            e = r[engine]
            vs = r.get(f"vs_{engine}")
            ratios = f"{vs['step_ratio']:18.2f} {vs['rss_ratio']:17.2f}" if vs else ""
            lines.append(
                f"{mode:<8} {engine:<10} {e['step_s']:7.3f} {e['peak_rss_mb']:13.0f} {ratios}"
            )
        if mode in result["deepspeed_errors"]:
            tail = result["deepspeed_errors"][mode].strip().splitlines()[-1:]
            lines.append(f"{mode:<8} deepspeed  failed: {' '.join(tail)}")
    return "\n".join(lines)


if __name__ == "__main__":  # one rank, started by run() through _ranks.launch
    spec = _ranks.rank_spec(sys.argv)
    if spec is None:
        sys.exit("this file runs as a rank of `z bench hf-trainer`; run that instead")
    _rank(spec)
