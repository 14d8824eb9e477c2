"""The tensor-parallel plan of Hugging Face's LLaMA layout (``LlamaForCausalLM``; Mistral and
Qwen2 share it), chosen from ``config.model_type``.

Per decoder layer: ``self_attn.q_proj``, ``k_proj``, ``v_proj`` column-parallel (cut by
heads: rank ``r`` holds query heads ``[r h/tp, (r+1) h/tp)`` and the key/value heads they
read, since ``h/kv`` is unchanged), ``o_proj`` row-parallel; ``mlp.gate_proj`` and
``up_proj`` column-parallel, ``down_proj`` row-parallel. ``model.embed_tokens`` is
vocabulary-parallel; ``lm_head`` is column-parallel over the vocabulary with its output
gathered, so the model returns full logits and Hugging Face's own loss runs unchanged
(tied heads share the embedding's shard). The attention modules reshape with ``-1`` heads,
so their forward is unchanged. RMSNorms stay whole on every rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zcore.comm import Comm
from zcore.tensor.layers import ColumnParallelLinear, RowParallelLinear
from zcore.tensor.plan import Plan, divides
from zcore.tensor.vocab import VocabParallelEmbedding

FAMILY = ("llama", "mistral", "qwen2")
"""``config.model_type`` values whose models have the LLaMA layout."""


def _matches(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "model_type", None) in FAMILY and hasattr(model, "lm_head")


def _problems(model: nn.Module, tp: int) -> list[str]:
    return config_problems(model.config, tp)


def config_problems(cfg: Any, tp: int) -> list[str]:
    """Every size of a LLaMA-layout model config (a transformers config, or any object with
    its attributes, such as ``config.json`` read by a CLI before any rank starts) that ``tp``
    does not divide, each with the numbers and the fix."""
    problems: list[str] = []
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    divides(problems, "num_attention_heads", heads, tp, "choose a tp that divides the heads")
    divides(
        problems,
        "num_key_value_heads",
        kv,
        tp,
        "choose a tp that divides the key/value heads (replicating KV heads is not supported)",
    )
    divides(problems, "intermediate_size", cfg.intermediate_size, tp, "choose a tp that divides it")
    divides(
        problems,
        "vocab_size",
        cfg.vocab_size,
        tp,
        "resize the token embeddings to a multiple of tp",
    )
    return problems


def _apply(model: nn.Module, comm: Comm, sequence_parallel: bool) -> None:
    if sequence_parallel:
        raise ValueError(
            "the llama plan has no sequence parallelism yet; call parallelize(..., "
            "sequence_parallel=False)"
        )
    inner = model.model
    tied = model.lm_head.weight is inner.embed_tokens.weight
    inner.embed_tokens = VocabParallelEmbedding.from_embedding(
        inner.embed_tokens, comm, "model.embed_tokens"
    )
    model.lm_head = ColumnParallelLinear.from_linear(
        model.lm_head,
        comm,
        gather_output=True,
        weight=inner.embed_tokens.weight if tied else None,
        name="lm_head",
    )
    for i, layer in enumerate(inner.layers):
        at, mlp, name = layer.self_attn, layer.mlp, f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            old = getattr(at, proj)
            setattr(
                at,
                proj,
                ColumnParallelLinear.from_linear(old, comm, name=f"{name}.self_attn.{proj}"),
            )
        at.o_proj = RowParallelLinear.from_linear(at.o_proj, comm, name=f"{name}.self_attn.o_proj")
        for proj in ("gate_proj", "up_proj"):
            old = getattr(mlp, proj)
            setattr(
                mlp, proj, ColumnParallelLinear.from_linear(old, comm, name=f"{name}.mlp.{proj}")
            )
        mlp.down_proj = RowParallelLinear.from_linear(
            mlp.down_proj, comm, name=f"{name}.mlp.down_proj"
        )


PLAN = Plan("llama", _matches, _problems, _apply)
