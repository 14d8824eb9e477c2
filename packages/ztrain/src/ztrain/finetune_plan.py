"""`z finetune`'s options, checked once into a :class:`FinetunePlan` before any rank starts.

A DeepSpeed user's `ds_config.json` is the source of the run's numbers, as it is for
`transformers.Trainer(deepspeed=...)`: where the config writes a number the Trainer also
takes (micro-batch, accumulation, clipping, learning rate, betas, eps, weight decay, warm-up,
total steps, bf16/fp16), the `TrainingArguments` get that number; where it writes `"auto"` or
nothing, the command's flags (or their defaults) decide and `zcore.hf.Trainer` fills the
config from them. A flag given as well as a different number in the config is the Trainer's
named conflict. Every key is parsed as the engine will parse it (an unknown key is an error
naming the valid ones), and the data file is read and checked line by line, here, without
importing transformers.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ztrain.finetune_data import FinetuneError, read_examples

DEFAULT_CONFIG: dict[str, Any] = {"zero_optimization": {"stage": 2}}
"""The ZeRO config without `--config`: stage 2, the Trainer's AdamW and linear schedule."""


@dataclass(frozen=True)
class FinetuneOptions:
    """What `z finetune` was given (None: not given, the config or a default decides)."""

    model_dir: Path
    data: Path
    config: Path | None = None
    out: Path = Path("runs/finetune")
    lora: int = 0
    base_bits: int = 0
    """With LoRA: store the frozen base's linears as INT8 or INT4 (QLoRA-style); 0: fp32."""
    epochs: float = 1.0
    max_steps: int | None = None
    seq_len: int = 512
    micro_batch: int | None = None
    grad_accum: int | None = None
    lr: float | None = None
    seed: int = 0
    save_every: int = 0
    eval_data: Path | None = None
    """A JSONL file like `data`, evaluated (mean loss) every `eval_every` steps and at the end."""
    eval_every: int = 0
    """Steps between evaluations of `eval_data`; 0: at the end only."""
    resume: bool = False
    """Continue from the latest `checkpoint-N` folder in `out/checkpoints` (any world size)."""
    tp: int = 1
    """Tensor-parallel ranks each layer is cut over (the config's `tensor_parallel.autotp_size`);
    the `tp` ranks of one data rank train on the same examples."""


@dataclass
class Args:
    """The `TrainingArguments` values of the run, readable by `zcore.hf.trainer_config`."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    learning_rate: float
    max_grad_norm: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    fp16: bool = False
    bf16: bool = False

    def get_warmup_steps(self, num_training_steps: int) -> int:
        return self.warmup_steps


@dataclass(frozen=True)
class FinetunePlan:
    """A checked run: the options, the config as given and the Trainer's arguments."""

    options: FinetuneOptions
    config: dict[str, Any]
    args: Args
    max_steps: int
    """-1: `epochs` epochs of the data."""
    examples: int
    notes: list[str] = field(default_factory=list)
    eval_examples: int = 0
    resume_from: Path | None = None
    """With `resume`: the `checkpoint-N` folder the run continues from."""

    @property
    def out(self) -> Path:
        return self.options.out

    @property
    def metrics(self) -> Path:
        return self.options.out / "metrics.jsonl"

    @property
    def final(self) -> Path:
        """The directory transformers and `z serve` load (with LoRA: the merged model)."""
        return self.options.out / "final"

    @property
    def adapter(self) -> Path:
        """With LoRA: the adapter directory `PeftModel.from_pretrained` loads."""
        return self.options.out / "adapter"

    @property
    def checkpoints(self) -> Path:
        """The Trainer's `checkpoint-N` folders (written with `save_every`)."""
        return self.options.out / "checkpoints"

    @property
    def stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks (the config's `tensor_parallel.autotp_size`, 1 without it)."""
        from zcore.hf.trainer_config import tp_size

        return tp_size(self.config)

    @property
    def data_parallel(self) -> int:
        """Ranks that read different examples: the world over `tp`."""
        return self.args.world_size // self.tp

    @property
    def step_rows(self) -> int:
        a = self.args
        return a.per_device_train_batch_size * a.gradient_accumulation_steps * self.data_parallel


def _number(config: dict[str, Any], key: str) -> float | None:
    """The config's value at dotted `key` when it is written as a number."""
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        return None
    return node


def _pick(flag: Any, written: float | None, default: Any) -> Any:
    return flag if flag is not None else written if written is not None else default


def load_ds_config(path: Path | None) -> dict[str, Any]:
    """The `--config` file as a dict (`DEFAULT_CONFIG` without one)."""
    if path is None:
        return json.loads(json.dumps(DEFAULT_CONFIG))
    if not Path(path).is_file():
        raise FinetuneError(f"--config `{path}` does not exist; pass a DeepSpeed ds_config.json")
    try:
        config = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise FinetuneError(
            f"--config `{path}` line {err.lineno}: not valid JSON ({err.msg})"
        ) from None
    if not isinstance(config, dict):
        raise FinetuneError(f"--config `{path}` is a JSON {type(config).__name__}, not an object")
    return config


def plan_finetune(opts: FinetuneOptions, world_size: int) -> FinetunePlan:
    """Check everything that can be checked without the model's weights; raises
    :class:`FinetuneError` or `zcore.config.ConfigError` (both `ValueError`) naming the problem."""
    from zcore.hf.trainer_config import check, fill_from_args

    model_config = opts.model_dir / "config.json"
    if not model_config.is_file():
        raise FinetuneError(
            f"`{opts.model_dir}` is not a Hugging Face model directory (no config.json); pass "
            "a directory written by `save_pretrained` (config.json, *.safetensors, tokenizer)"
        )
    hidden = json.loads(model_config.read_text()).get("hidden_size")
    if opts.lora < 0:
        raise FinetuneError(f"--lora {opts.lora}: the LoRA rank must be >= 1 (0: full fine-tune)")
    if opts.base_bits and (opts.base_bits not in (8, 4) or not opts.lora):
        raise FinetuneError(
            f"--base-bits {opts.base_bits}: a quantized frozen base is 8 or 4 bits and needs "
            "--lora R (only the adapter trains over it)"
        )
    examples = read_examples(opts.data)
    config = with_tp(load_ds_config(opts.config), opts, world_size)
    c = lambda key: _number(config, key)  # noqa: E731
    betas = config.get("optimizer", {}).get("params", {}).get("betas")
    betas = betas if isinstance(betas, list) and len(betas) == 2 else None
    default_lr = 2e-4 if opts.lora else 2e-5
    args = Args(
        per_device_train_batch_size=int(
            _pick(opts.micro_batch, c("train_micro_batch_size_per_gpu"), 1)
        ),
        gradient_accumulation_steps=int(
            _pick(opts.grad_accum, c("gradient_accumulation_steps"), 1)
        ),
        world_size=world_size,
        learning_rate=float(_pick(opts.lr, c("optimizer.params.lr"), default_lr)),
        max_grad_norm=float(_pick(None, c("gradient_clipping"), 1.0)),
        adam_beta1=float(betas[0]) if betas else 0.9,
        adam_beta2=float(betas[1]) if betas else 0.999,
        adam_epsilon=float(_pick(None, c("optimizer.params.eps"), 1e-8)),
        weight_decay=float(_pick(None, c("optimizer.params.weight_decay"), 0.0)),
        warmup_steps=int(_pick(None, c("scheduler.params.warmup_num_steps"), 0)),
        fp16=config.get("fp16", {}).get("enabled") is True,
        bf16=config.get("bf16", {}).get("enabled") is True,
    )
    filled = fill_from_args(config, args)
    check(filled, args, hidden)  # every key, the optimizer and scheduler, the batch arithmetic
    max_steps = _pick(opts.max_steps, c("scheduler.params.total_num_steps"), -1)
    plan = FinetunePlan(opts, config, args, int(max_steps), len(examples))
    whole = plan.examples // plan.step_rows * plan.step_rows
    if whole == 0:
        raise FinetuneError(
            f"`{opts.data}` has {plan.examples} examples, fewer than one optimizer step of "
            f"{plan.step_rows} (micro-batch {args.per_device_train_batch_size} x accumulation "
            f"{args.gradient_accumulation_steps} x {plan.data_parallel} data-parallel rank(s)); "
            "add examples or lower --micro-batch, --grad-accum or --nproc"
        )
    if whole < plan.examples:
        plan.notes.append(
            f"{plan.examples - whole} of {plan.examples} examples are left out of each epoch "
            f"(an optimizer step takes {plan.step_rows}; the engine takes whole steps only)"
        )
    if opts.lora and plan.stage not in (2, 3):
        plan.notes.append(
            f"LoRA at ZeRO stage {plan.stage}: only the adapter trains; stage 2 or 3 also "
            "shards its optimizer state"
        )
    if opts.eval_every and opts.eval_data is None:
        raise FinetuneError(f"--eval-every {opts.eval_every} needs --eval-data FILE (JSONL)")
    if opts.eval_data is not None:
        plan = replace(plan, eval_examples=_eval_examples(plan))
    if opts.resume:
        plan = replace(plan, resume_from=latest_checkpoint(plan.checkpoints))
    if opts.base_bits and plan.stage == 3:
        plan.notes.append(
            f"--base-bits {opts.base_bits} at ZeRO-3: each rank builds the model whole to "
            "quantize it; the packed base stays whole on every rank (only the full-precision "
            "parameters are partitioned)"
        )
    return plan


def with_tp(config: dict[str, Any], opts: FinetuneOptions, world_size: int) -> dict[str, Any]:
    """`config` with `--tp` as its `tensor_parallel.autotp_size`, after checking that the
    layout fits: the ranks, the model's sizes (LLaMA/Mistral/Qwen2: heads, key/value heads,
    MLP and vocabulary divisible by tp) and no LoRA (the adapter wraps the linears tp cuts)."""
    from zcore.hf.trainer_config import tp_size

    block = config.get("tensor_parallel")
    written = tp_size(config)
    if opts.tp > 1:
        if isinstance(block, dict) and "autotp_size" in block and written != opts.tp:
            raise FinetuneError(
                f"--tp {opts.tp} but --config `{opts.config}` has tensor_parallel.autotp_size "
                f"{block['autotp_size']}; drop --tp or the config's key"
            )
        config = {**config, "tensor_parallel": {**(block or {}), "autotp_size": opts.tp}}
    tp = tp_size(config)
    if tp == 1:
        return config
    if world_size % tp:
        raise FinetuneError(
            f"--nproc {world_size} is not a multiple of --tp {tp} ({world_size} % {tp} = "
            f"{world_size % tp}); use --nproc {tp * max(1, world_size // tp)} (tp x "
            "data-parallel ranks) or a --tp that divides it"
        )
    if opts.lora:
        raise FinetuneError(
            f"--tp {tp} with --lora {opts.lora}: tensor parallelism cuts the linears the LoRA "
            "adapter wraps, which is not built; drop --tp (ZeRO shards the model over the "
            "ranks instead) or --lora"
        )
    from types import SimpleNamespace

    from zcore.tensor.llama_plan import FAMILY, config_problems

    raw = json.loads((opts.model_dir / "config.json").read_text())
    kind = raw.get("model_type")
    if kind not in FAMILY:
        raise FinetuneError(
            f"--tp {tp}: `{opts.model_dir}` is a {kind!r} model; tensor parallelism has a plan "
            f"for {', '.join(FAMILY)} models; drop --tp (ZeRO shards the model instead)"
        )
    fields = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
    problems = config_problems(SimpleNamespace(**{k: raw.get(k) for k in fields}), tp)
    if problems:
        raise FinetuneError(
            f"--tp {tp}: cannot cut `{opts.model_dir}` ({kind}) over {tp} ranks:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    return config


def _eval_examples(plan: FinetunePlan) -> int:
    """The examples of `eval_data` evaluated (whole batches of every rank); every line is
    checked, and a file without one batch is an error."""
    o, a = plan.options, plan.args
    assert o.eval_data is not None
    n = len(read_examples(o.eval_data))
    batch = a.per_device_train_batch_size * plan.data_parallel
    if n < batch:
        raise FinetuneError(
            f"--eval-data `{o.eval_data}` has {n} examples, fewer than one evaluation batch of "
            f"{batch} (micro-batch {a.per_device_train_batch_size} x {plan.data_parallel} "
            "data-parallel rank(s)); "
            "add examples or lower --micro-batch or --nproc"
        )
    if n % batch:
        plan.notes.append(
            f"{n % batch} of {n} evaluation examples are left out (whole batches of {batch})"
        )
    return n // batch * batch


def latest_checkpoint(checkpoints: Path) -> Path:
    """The `checkpoint-N` folder with the largest N under `checkpoints` (a
    :class:`FinetuneError` when there is none)."""
    found = [
        p
        for p in checkpoints.glob("checkpoint-*")
        if p.is_dir() and p.name.split("-", 1)[1].isdigit()
    ]
    if not found:
        raise FinetuneError(
            f"--resume: no checkpoint-N folder in `{checkpoints}`; a run writes them with "
            "--save-every N (same --out), or drop --resume to start afresh"
        )
    return max(found, key=lambda p: int(p.name.split("-", 1)[1]))


def steps_per_epoch(plan: FinetunePlan) -> int:
    """Optimizer steps in one epoch of the (whole-step) data."""
    return plan.examples // plan.step_rows


def total_steps(plan: FinetunePlan) -> int:
    """The run's optimizer steps."""
    if plan.max_steps > 0:
        return plan.max_steps
    return max(1, math.ceil(plan.options.epochs * steps_per_epoch(plan)))


def rank_world() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment (one rank without one)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
