"""A `z train --moe` model as a Hugging Face Mixtral checkpoint directory.

    config.json             model_type "mixtral", architectures ["MixtralForCausalLM"]
    model.safetensors       fp32, Mixtral's on-disk names: model.layers.{i}.block_sparse_moe.
                            gate.weight and ...experts.{e}.w1/w2/w3.weight (what
                            `save_pretrained` writes; transformers 5 fuses them on load)
    generation_config.json  eos/bos = `<|endoftext|>`
    tokenizer.json          the run's byte-level BPE
    tokenizer_config.json   PreTrainedTokenizerFast, `<|endoftext|>` as eos/bos/unk

transformers (`MixtralForCausalLM.from_pretrained`) and zserve load it. Only a model whose
every layer is Mixtral's can be written: every layer MoE with the same expert count, top-k
with k >= 2 (Mixtral renormalises the k weights to sum 1; zmoe's top-1 weight is the
probability itself), softmax router, no residual MoE, no aux-loss-free bias. A model
trained with a capacity limit exports too: its routing is Mixtral's, but Mixtral drops no
token, so its outputs are those of the same model run dropless.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ztrain.atomic_dir import write_dir_atomically
from ztrain.moe_lm import MoELMConfig
from ztrain.tokenizer import EOT, Tokenizer


class ExportError(ValueError):
    """The model cannot be written as a Mixtral checkpoint; the message says why."""


def check_exportable(config: MoELMConfig) -> None:
    """Raise ExportError naming every layer setting Mixtral has no equivalent for."""
    problems = []
    dense = [i for i, e in enumerate(config.experts) if e == 0]
    if dense:
        problems.append(
            f"layers {dense} are dense (Mixtral has an MoE block in every layer; train with "
            "`--moe-layers every`)"
        )
    counts = sorted(set(config.experts) - {0})
    if len(counts) > 1:
        problems.append(
            f"layers have different expert counts {list(config.experts)} (a PR-MoE pyramid; "
            "Mixtral has one `num_local_experts`)"
        )
    if config.k < 2:
        problems.append(
            f"top-k {config.k}: Mixtral renormalises the chosen weights to sum 1, so its top-1 "
            "weight is 1, not the router probability zmoe uses; train with `--moe-top-k 2`"
        )
    if config.router != "softmax":
        problems.append(f"router {config.router!r} (Mixtral's is softmax)")
    if config.use_residual:
        problems.append("a residual MoE (use_residual; Mixtral has none)")
    if config.aux_loss_free_bias:
        problems.append("an aux-loss-free routing bias (Mixtral has none)")
    if problems:
        raise ExportError("cannot export as Mixtral: " + "; ".join(problems))


def hf_config(config: MoELMConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """Mixtral's `config.json` for `config` (after `check_exportable`)."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.expert_ffn,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_head,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,  # transformers 4
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},  # 5
        "num_local_experts": config.experts[0],
        "num_experts_per_tok": config.k,
        "router_aux_loss_coef": config.aux_loss_coef,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.eot_id,
        "eos_token_id": tokenizer.eot_id,
        "use_cache": True,
        "torch_dtype": "float32",
    }


_ROUTER = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.gate)\.wg\.weight$")


def hf_state_dict(
    state: Mapping[str, torch.Tensor], config: MoELMConfig
) -> dict[str, torch.Tensor]:
    """Our consolidated state_dict under Mixtral's names (fp32, contiguous, CPU).

    Every name is ours already except the router (`gate.wg.weight` -> `gate.weight`);
    the expected key set is checked so a missing expert is named, not silently skipped.
    """
    out = {}
    for name, tensor in state.items():
        if name in ("rope_cos", "rope_sin") or name.endswith("gate.expert_bias"):
            continue  # non-persistent buffers (zcore's checkpoint holds them too)
        out[_ROUTER.sub(r"\1.weight", name)] = tensor.detach().to("cpu", torch.float32).clone()
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i, experts in enumerate(config.experts):
        p = f"model.layers.{i}."
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        expected |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        expected.add(p + "block_sparse_moe.gate.weight")
        expected |= {
            p + f"block_sparse_moe.experts.{e}.w{w}.weight" for e in range(experts) for w in "123"
        }
    missing, extra = sorted(expected - set(out)), sorted(set(out) - expected)
    if missing or extra:
        raise ExportError(
            f"the checkpoint does not hold this model: missing {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}, unexpected {extra[:4]}"
            f"{' ...' if len(extra) > 4 else ''}"
        )
    return out


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": EOT,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }


def export_mixtral(
    state: Mapping[str, torch.Tensor],
    config: MoELMConfig,
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike[str],
) -> Path:
    """Write the Mixtral directory (module docstring) atomically; return its path."""
    check_exportable(config)
    weights = hf_state_dict(state, config)

    def fill(tmp: Path) -> None:
        files = {
            "config.json": hf_config(config, tokenizer),
            "generation_config.json": {
                "bos_token_id": tokenizer.eot_id,
                "eos_token_id": tokenizer.eot_id,
            },
            "tokenizer_config.json": _tokenizer_config(),
        }
        for name, body in files.items():
            (tmp / name).write_text(json.dumps(body, indent=2) + "\n")
        tokenizer.save(tmp / "tokenizer.json")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return write_dir_atomically(out_dir, fill)


def export_run(
    run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], tag: str | None = None
) -> tuple[Path, MoELMConfig]:
    """Consolidate a `z train --moe` run's checkpoint (`RUN/checkpoints`, or that folder
    itself) and write it as Mixtral to `out_dir`; FileNotFoundError/ExportError say why not."""
    from zcore.checkpoint import consolidate
    from ztrain.moe_plan import config_from_dict

    run = Path(run_dir)
    root = run / "checkpoints" if (run / "checkpoints" / "latest").is_file() else run
    if not (root / "latest").is_file() and tag is None:
        raise FileNotFoundError(
            f"`{run}` is not a `z train` run or checkpoint directory (no `checkpoints/latest`); "
            "pass the `--out` of `z train --moe`"
        )
    missing = [n for n in ("model.json", "tokenizer.json") if not (root / n).is_file()]
    if missing:
        raise FileNotFoundError(f"`{root}` has no {' or '.join(missing)}; is it a `z train` run?")
    config = config_from_dict(json.loads((root / "model.json").read_text()), ep_size=1)
    if not isinstance(config, MoELMConfig):
        raise ExportError(
            f"`{run}` holds a GPT (`z train` without `--moe`); only a `z train --moe` model "
            "exports as Mixtral"
        )
    check_exportable(config)  # before the (slow) consolidation
    state = consolidate(str(root), tag)
    out = export_mixtral(state, config, Tokenizer.load(root / "tokenizer.json"), out_dir)
    return out, config
