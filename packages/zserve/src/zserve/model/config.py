"""The LLaMA-family hyper-parameters, read from a Hugging Face ``config.json``.

Covers LLaMA 1-3, Mistral and SmolLM2-style checkpoints: RMSNorm, rotary position
embeddings (plain, or with LLaMA-3.1 frequency scaling), grouped-query attention and a
SwiGLU MLP; and Mixtral, the same decoder with a sparse mixture of SwiGLU experts in
place of the MLP (``num_local_experts``, top-``num_experts_per_tok`` routing). Both spellings of the rotary base are accepted: ``rope_theta`` at the top
level (transformers 4) and ``rope_parameters.rope_theta`` (transformers 5).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: ``model_type`` values this runner implements, and the HF architecture class names.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "mixtral")
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
)
#: Mixtral's expert counts when config.json leaves them out (transformers' defaults).
MIXTRAL_DEFAULT_EXPERTS, MIXTRAL_DEFAULT_TOP_K = 8, 2
#: rotary variants (HF ``rope_type``) this runner implements.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """LLaMA-3.1 rotary frequency scaling (HF ``rope_type: "llama3"``)."""

    factor: float
    """How much longer the target context is than the trained one."""
    low_freq_factor: float
    """Wavelengths longer than ``original_max / low_freq_factor`` are divided by ``factor``."""
    high_freq_factor: float
    """Wavelengths shorter than ``original_max / high_freq_factor`` are kept."""
    original_max_position_embeddings: int
    """The context length the model was pre-trained at."""


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a LLaMA-family decoder, as in its ``config.json``."""

    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP's gate/up projections."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention); divides ``num_attention_heads`` (plus
    ``sum(attention_pad)``)."""
    head_dim: int
    """Width of one head; ``hidden_size // num_attention_heads`` unless the config says."""
    max_position_embeddings: int
    """Longest sequence the model supports (tokens)."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    rope_scaling: RopeScaling | None = None
    """LLaMA-3.1 frequency scaling, or None for plain rotary embeddings."""
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding matrix (no ``lm_head.weight`` tensor)."""
    attention_bias: bool = False
    """q/k/v/o projections carry biases."""
    mlp_bias: bool = False
    """gate/up/down projections carry biases."""
    sliding_window: int | None = None
    """Mistral's attention window; None for full attention."""
    num_local_experts: int = 0
    """Mixtral: SwiGLU experts per layer (each ``intermediate_size`` wide); 0 = dense MLP."""
    num_experts_per_tok: int = 0
    """Mixtral: experts each token is routed to (top-k of the router's softmax)."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence token ids named by ``config.json``."""
    model_type: str = "llama"
    """HF ``model_type`` the config was read from."""
    torch_dtype: str | None = None
    """The dtype the checkpoint was saved in, if the config says."""
    attention_pad: tuple[int, int] = (0, 0)
    """A tensor-parallel shard's empty query-head slots before and after its query heads,
    which make its KV heads' query groups whole (:mod:`zserve.tp.plan`): the attention runs
    over :attr:`attention_heads` heads, the projections over ``num_attention_heads``."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The raw ``config.json`` (for fields this runner does not use)."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.json: `{name}` must be a positive integer; got {value!r}")
        if min(self.attention_pad) < 0:
            raise ValueError(f"attention_pad {self.attention_pad} must be >= 0")
        if self.attention_heads % self.num_key_value_heads:
            padded = (
                f" (+ {sum(self.attention_pad)} empty slots)" if any(self.attention_pad) else ""
            )
            raise ValueError(
                f"config.json: num_attention_heads {self.num_attention_heads}{padded} is not a "
                f"multiple of num_key_value_heads {self.num_key_value_heads}"
            )
        if self.num_local_experts and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok {self.num_experts_per_tok} must be in "
                f"[1, num_local_experts {self.num_local_experts}]"
            )
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim {self.head_dim} must be even for rotary")

    @property
    def attention_heads(self) -> int:
        """Query-head slots of the attention: the query heads and :attr:`attention_pad`."""
        return self.num_attention_heads + sum(self.attention_pad)

    @property
    def q_size(self) -> int:
        """Width of all query heads together."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of all key (or value) heads together."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Parse a ``config.json`` dictionary; ValueError names an unsupported model or field."""
        model_type = raw.get("model_type")
        archs = raw.get("architectures") or []
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json: model_type {model_type!r} (architectures {archs}) is not "
                f"supported; zserve runs model_type in {list(SUPPORTED_MODEL_TYPES)} "
                f"({', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if bad:
            raise ValueError(
                f"config.json: architecture {bad[0]!r} is not supported; zserve runs "
                f"{list(SUPPORTED_ARCHITECTURES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r} is not supported; expected 'silu'")
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in raw
        ]
        if missing:
            raise ValueError(f"config.json: required field(s) {missing} are missing")
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        theta, scaling = _rope(raw)
        experts, top_k = 0, 0
        if model_type == "mixtral":
            experts = raw.get("num_local_experts", MIXTRAL_DEFAULT_EXPERTS)
            top_k = raw.get("num_experts_per_tok", MIXTRAL_DEFAULT_TOP_K)
            for name, value in (("num_local_experts", experts), ("num_experts_per_tok", top_k)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(
                        f"config.json: `{name}` must be a positive integer; got {value!r}"
                    )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=raw.get("sliding_window"),
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            eos_token_ids=eos_ids,
            model_type=model_type,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            extra=dict(raw),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> LlamaConfig:
        """Read ``model_dir/config.json``; FileNotFoundError when it is missing."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            what = "directory" if Path(model_dir).is_dir() else "no such directory"
            raise FileNotFoundError(
                f"no config.json in `{model_dir}` ({what}); pass a Hugging Face model directory "
                "holding config.json and *.safetensors"
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"`{path}` is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    def inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies, fp32 ``(head_dim // 2,)``, computed as transformers does."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponent)
        s = self.rope_scaling
        if s is None:
            return inv_freq
        # LLaMA 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth
        # interpolation in between (transformers' _compute_llama3_parameters).
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either the transformers-4 or the transformers-5 layout."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope_type {rope_type!r} is not supported; zserve implements "
            f"{list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ValueError(f"config.json: llama3 rope scaling lacks {exc.args[0]!r}") from exc
    return theta, scaling
