"""`EngineConfig`: every knob of the serving engine, validated at construction."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Policy = Literal["splitfuse", "prefill-first", "static"]
DType = Literal["float32", "bfloat16", "float16"]

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""Seeds accepted (engine and per request): a signed 64-bit integer, OpenAI's `seed`;
torch's generators refuse wider ones."""


class EngineConfig(BaseModel):
    """How the engine schedules, caches and runs requests.

    Unknown fields are rejected, so a typo (`token_buget=`) fails loudly instead of
    silently keeping the default.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Policy = "splitfuse"
    """Scheduling policy. `splitfuse` (Dynamic SplitFuse): every forward is filled to
    `token_budget` tokens, decodes first, then prompt chunks split across forwards.
    `prefill-first`: continuous batching that runs whole prompts in a forward of their
    own before any decode (early vLLM). `static`: transformers `generate` on padded
    batches (the baseline; needs `transformers`)."""

    token_budget: int = Field(default=256, ge=1, le=1 << 20)
    """Tokens per forward under `splitfuse` (decodes + prompt chunks together)."""

    max_num_seqs: int = Field(default=32, ge=1, le=4096)
    """Most sequences alive (holding KV blocks) at once; also the static batch size."""

    block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per KV-cache block."""

    num_blocks: int | None = Field(default=None, ge=1)
    """KV-cache blocks. None: derived from `kv_cache_bytes` (or the runner's default)."""

    kv_cache_bytes: int | None = Field(default=None, ge=1)
    """KV-cache size in bytes, used when `num_blocks` is None."""

    prefix_caching: bool = True
    """Reuse full KV blocks across requests that share a token prefix."""

    max_model_len: int | None = Field(default=None, ge=2)
    """Longest sequence (prompt + output) in tokens. None: the model's own limit."""

    dtype: DType = "float32"
    """Weights and KV-cache dtype of the model runner."""

    device: str = "cpu"
    """Torch device of the model runner (`cpu`, `cuda`, `cuda:1`...)."""

    seed: int = Field(default=0, ge=SEED_MIN, le=SEED_MAX)
    """Seed (64-bit) of the sampler for requests that give no seed of their own."""

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError(
                f"give num_blocks ({self.num_blocks}) or kv_cache_bytes "
                f"({self.kv_cache_bytes}), not both"
            )
        return self

    @property
    def torch_dtype(self):  # -> torch.dtype, kept lazy so the config imports without torch
        """The `dtype` field as a `torch.dtype`."""
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            self.dtype
        ]
