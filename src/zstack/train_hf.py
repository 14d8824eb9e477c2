"""`z train --model HF_DIR`: a Hugging Face causal LM trained on `z train`'s Shakespeare
through `z finetune` (zcore.hf.Trainer, the path a DeepSpeed AutoTP user knows).

The plays are written as JSONL into `OUT/data/` (one example per stretch of about three
characters a token of `--seq-len`; with `--eval-every`, every twentieth stretch is held out,
at most `HELD_MAX` of them), and `z finetune` runs on them with the `z train` options that mean the same there.
Options that shape `z train`'s own GPT are refused by name.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from ztrain.moe_plan import MOE_FLAGS

#: `z train` options with no meaning for a Hugging Face model (its config is the model's).
GPT_ONLY = (
    "preset",
    "vocab_size",
    "moe",
    *MOE_FLAGS,
    "dense_twin",
    "pp",
    "schedule",
    "microbatches",
    "cp",
    "cp_mode",
)
#: `z train` option -> `z finetune` option, passed on when given.
PASSED = {
    "micro_batch": "--micro-batch",
    "grad_accum": "--grad-accum",
    "lr": "--lr",
    "seed": "--seed",
    "save_every": "--save-every",
    "eval_every": "--eval-every",
}
HOLD_OUT = 20
"""With `--eval-every`: every HOLD_OUT-th stretch of text is evaluation data..."""
HELD_MAX = 256
"""...up to this many stretches (each evaluation reads them all)."""


def refused(explicit: frozenset[str]) -> list[str]:
    """The given options `--model` cannot honour, as flags."""
    return ["--" + k.replace("_", "-") for k in GPT_ONLY if k in explicit]


def write_data(folder: Path, seq_len: int, hold_out: bool) -> tuple[Path, Path | None]:
    """The plays as JSONL examples of about `seq_len` tokens (cut at line ends): the
    training file, and the held-out one when `hold_out`."""
    from ztrain.data import load_plays

    folder.mkdir(parents=True, exist_ok=True)
    chars = 3 * seq_len
    stretches: list[str] = []
    for _, text in load_plays():
        piece: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= chars:
                stretches.append("".join(piece))
                piece, size = [], 0
        if piece:
            stretches.append("".join(piece))
    held_at = set(range(0, len(stretches), HOLD_OUT)[:HELD_MAX]) if hold_out else set()
    train = [s for i, s in enumerate(stretches) if i not in held_at]
    held = [stretches[i] for i in sorted(held_at)]
    train_path = folder / "shakespeare.jsonl"
    train_path.write_text("".join(json.dumps({"text": s}) + "\n" for s in train))
    if not hold_out:
        return train_path, None
    held_path = folder / "shakespeare-val.jsonl"
    held_path.write_text("".join(json.dumps({"text": s}) + "\n" for s in held))
    return train_path, held_path


def finetune_argv(model: Path, params: dict[str, Any], explicit: frozenset[str]) -> list[str]:
    """`z finetune` arguments for this `z train --model` run (the data written first)."""
    out = Path(params["out"])
    seq_len = params["seq_len"] or 256
    hold_out = "eval_every" in explicit
    data, held = write_data(out / "data", seq_len, hold_out)
    argv = ["finetune", str(model), str(data), "--out", str(out), "--seq-len", str(seq_len)]
    argv += ["--nproc", str(params["nproc"]), "--tp", str(params["tp"])]
    argv += ["--max-steps", str(params["steps"])]
    if held is not None:
        argv += ["--eval-data", str(held)]
    for key, flag in PASSED.items():
        if key in explicit:
            argv += [flag, str(params[key])]
    if params["resume"]:
        argv.append("--resume")
    config = params["config"]
    if config is None and explicit & {"stage", "bf16"}:
        config = out / "data" / "ds_config.json"
        ds: dict[str, Any] = {"zero_optimization": {"stage": params["stage"]}}
        if params["bf16"]:
            ds["bf16"] = {"enabled": True}
        config.write_text(json.dumps(ds, indent=2))
    if config is not None:
        argv += ["--config", str(config)]
    return argv


def run(z_script: str, model: Path, params: dict[str, Any], explicit: frozenset[str]) -> int:
    """`z finetune` for `model` with these options; its exit code."""
    argv = finetune_argv(model, params, explicit)
    print(f"z train --model: z {' '.join(argv)}", flush=True)
    return subprocess.run([z_script, *argv]).returncode
