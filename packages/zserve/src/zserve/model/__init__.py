"""The LLaMA-family models of zserve (Mixtral included): config, weights, and ragged paged
attention."""

from zserve.model.attention import (
    AttentionPlan,
    paged_attention_reference,
    plan_ragged_attention,
    ragged_paged_attention,
)
from zserve.model.checkpoint import SafetensorsCheckpoint, WeightsMismatchError
from zserve.model.config import LlamaConfig, RopeScaling
from zserve.model.llama import LlamaModel
from zserve.model.mixtral import SparseMoE

__all__ = [
    "AttentionPlan",
    "LlamaConfig",
    "LlamaModel",
    "RopeScaling",
    "SafetensorsCheckpoint",
    "SparseMoE",
    "WeightsMismatchError",
    "paged_attention_reference",
    "plan_ragged_attention",
    "ragged_paged_attention",
]
