"""The LLaMA-family model of zserve: config, weights, and ragged paged attention."""

from zserve.model.attention import (
    AttentionPlan,
    paged_attention_reference,
    plan_ragged_attention,
    ragged_paged_attention,
)
from zserve.model.config import LlamaConfig, RopeScaling
from zserve.model.llama import LlamaModel, SafetensorsCheckpoint, WeightsMismatchError

__all__ = [
    "AttentionPlan",
    "LlamaConfig",
    "LlamaModel",
    "RopeScaling",
    "SafetensorsCheckpoint",
    "WeightsMismatchError",
    "paged_attention_reference",
    "plan_ragged_attention",
    "ragged_paged_attention",
]
