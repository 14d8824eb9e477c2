"""`EngineConfig`: every knob of the serving engine, validated at construction."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Policy = Literal["splitfuse", "prefill-first", "static"]
DType = Literal["float32", "bfloat16", "float16"]
Speculative = Literal["ngram", "self-draft"]
Offload = Literal["cpu", "nvme"]
TPCollectives = Literal["p2p", "gloo"]
CpuIdle = Literal["auto", "poll", "halt"]

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

    speculative: Speculative | None = None
    """Speculative decoding (see `zserve.speculative`): `ngram`
    proposes the tokens that followed the last n-gram's previous occurrence in the
    prompt + output (vLLM's `method: "ngram"`, prompt lookup); `self-draft` runs the
    first `draft_layers` layers of the model itself (plus its final norm and head) as
    the draft. Drafts are verified in the SplitFuse forward: greedy output is unchanged,
    and sampled requests (temperature > 0) keep plain sampling's distribution through
    speculative sampling's acceptance; a request with a seed decodes plainly. None: off.
    vLLM's
    `speculative_config={"method": ..., "num_speculative_tokens": ...}` is accepted too."""

    num_speculative_tokens: int = Field(default=4, ge=1, le=64)
    """Most draft tokens verified per sequence and step (each counts in `token_budget`)."""

    prompt_lookup_max: int = Field(default=4, ge=1, le=64)
    """`ngram`: longest n-gram matched (tried first)."""

    prompt_lookup_min: int = Field(default=2, ge=1, le=64)
    """`ngram`: shortest n-gram matched before giving up on a step's draft."""

    draft_layers: int | None = Field(default=None, ge=1)
    """`self-draft`: layers of the draft; None: all but the last eighth of the model's
    (an early exit from a model not trained for it agrees with the full model only near
    full depth: SmolLM2-135M accepts ~1% of drafts at 15 of 30 layers, ~18% at 28)."""

    weights_budget: int | str | None = None
    """Bytes of decoder-layer weights held in memory (``64M``, ``1.5G`` or bytes): the
    layers that fit stay resident, the rest stream from `offload` each forward
    (:mod:`zserve.offload`). None: every layer resident."""

    offload: Offload | None = None
    """Where the layers beyond `weights_budget` live: `cpu` (host memory, the default) or
    `nvme` (a swap file under `offload_dir`, read with O_DIRECT)."""

    offload_dir: str | None = None
    """The directory of `nvme`'s swap file."""

    prefetch_layers: int = Field(default=1, ge=1, le=8)
    """Streamed layers fetched ahead of the one computing."""

    tp: int = Field(default=1, ge=1, le=512)
    """Tensor-parallel ranks (:mod:`zserve.tp`): this process is rank 0 (scheduler,
    sampling, HTTP) and starts ranks ``1 .. tp-1``; each holds its heads, MLP columns, LM-head
    rows and its KV heads' cache. Any head count up to ``num_attention_heads``."""

    tp_timeout_s: float = Field(default=120.0, gt=0)
    """Seconds a step's collective waits for a tensor-parallel rank before the engine stops
    with an error naming it."""

    tp_collectives: TPCollectives = "p2p"
    """What carries the tensor-parallel layers' all-reduces and gathers and each step's batch
    over the ranks' gloo groups: `p2p`, point-to-point sends and receives (:mod:`zserve.tp.p2p`:
    one exchange per all-reduce at 2 ranks), or `gloo`, the groups' collectives."""

    cpu_idle: CpuIdle = "auto"
    """How the host's idle cores wait while requests are in flight (:mod:`zserve.cpu_idle`):
    `poll` holds Linux's CPU latency QoS at 0 us (`/dev/cpu_dma_latency`) from the first
    forward until nothing is unfinished, so a rank waiting on another is woken without a
    halted core's wake-up (an error where the process may not write the device); `halt`
    leaves the kernel's choice; `auto` is `poll` for `tp > 1` where the process may, else
    `halt`."""

    @model_validator(mode="before")
    @classmethod
    def _vllm_speculative_config(cls, data: object) -> object:
        """Map vLLM's `speculative_config` dict onto the flat fields above."""
        if not isinstance(data, dict) or "speculative_config" not in data:
            return data
        data = dict(data)
        spec = data.pop("speculative_config")
        if spec is None:
            return data
        if not isinstance(spec, dict):
            raise ValueError(
                f"speculative_config is {spec!r}; pass a dict such as "
                '{"method": "ngram", "num_speculative_tokens": 4}'
            )
        spec = dict(spec)
        if spec.get("model") is not None:
            raise ValueError(
                f"speculative_config.model {spec['model']!r}: a separate draft checkpoint is "
                'not supported; use {"method": "self-draft", "draft_layers": L}'
            )
        spec.pop("model", None)
        if "method" in spec:
            data["speculative"] = spec.pop("method")
        allowed = {
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "draft_layers",
        }
        unknown = sorted(set(spec) - allowed)
        if unknown:
            raise ValueError(
                f"speculative_config keys {unknown} are not supported; use `method` and "
                f"{sorted(allowed)}"
            )
        data.update(spec)
        return data

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.speculative is not None and self.policy != "splitfuse":
            raise ValueError(
                f"speculative {self.speculative!r} needs policy 'splitfuse' (drafts are "
                f"verified inside its forwards); got policy {self.policy!r}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min {self.prompt_lookup_min} > prompt_lookup_max "
                f"{self.prompt_lookup_max}; lower the min or raise the max"
            )
        if self.draft_layers is not None and self.speculative != "self-draft":
            raise ValueError(
                f"draft_layers {self.draft_layers} is for speculative 'self-draft'; got "
                f"speculative {self.speculative!r}"
            )
        if self.weights_budget is None and (self.offload or self.offload_dir):
            raise ValueError(
                f"offload {self.offload!r} / offload_dir {self.offload_dir!r} need "
                "weights_budget; pass `--weights-budget SIZE`"
            )
        if self.weights_budget is not None and (
            self.speculative is not None or self.policy == "static"
        ):
            raise ValueError(
                f"weights_budget serves with policy 'splitfuse' or 'prefill-first' and no "
                f"speculative decoding; got policy {self.policy!r}, speculative "
                f"{self.speculative!r}"
            )
        if self.tp > 1 and (
            self.speculative == "self-draft"
            or self.policy == "static"
            or self.weights_budget is not None
            or self.device != "cpu"
        ):
            raise ValueError(
                f"tp {self.tp} serves with policy 'splitfuse' or 'prefill-first' on device "
                "'cpu', without self-draft speculation or weights_budget; got policy "
                f"{self.policy!r}, device {self.device!r}, speculative {self.speculative!r}, "
                f"weights_budget {self.weights_budget!r}"
            )
        if self.cpu_idle == "poll" and self.policy == "static":
            raise ValueError(
                "cpu_idle 'poll' is held by the engine (policy 'splitfuse' or 'prefill-first'); "
                "the 'static' baseline runs transformers `generate`: drop cpu_idle or change policy"
            )
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError(
                f"give num_blocks ({self.num_blocks}) or kv_cache_bytes "
                f"({self.kv_cache_bytes}), not both"
            )
        return self

    def offload_spec(self):  # -> zserve.offload.OffloadSpec | None, lazy like torch_dtype
        """`weights_budget` and the offload fields as an `OffloadSpec`; None without a budget."""
        if self.weights_budget is None:
            return None
        from zserve.offload import OffloadSpec, parse_size

        return OffloadSpec(
            budget=parse_size(self.weights_budget),
            kind=self.offload or "cpu",
            directory=self.offload_dir,
            prefetch=self.prefetch_layers,
        )

    @property
    def torch_dtype(self):  # -> torch.dtype, kept lazy so the config imports without torch
        """The `dtype` field as a `torch.dtype`."""
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            self.dtype
        ]
