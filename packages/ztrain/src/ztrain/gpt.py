"""A nanoGPT-style decoder-only transformer: the model `z train` trains.

Every parameter belongs to a leaf module (`nn.Linear`, `nn.Embedding`,
`nn.LayerNorm`) so a ZeRO stage-3 engine can gather parameters per module with
forward hooks. With `tie_weights` the token embedding and the LM head share one
`Parameter` (`transformer.wte.weight is lm_head.weight`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a `GPT`; `to_dict`/`from_dict` are its `model.json`."""

    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads; must divide n_embd."""
    n_embd: int
    """Model width (d)."""
    block_size: int
    """Longest context, in tokens (learned position embeddings)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    bias: bool = True
    """Biases in the Linear layers and LayerNorms."""
    tie_weights: bool = True
    """Share the token embedding with the LM head."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd {self.n_embd} is not divisible by n_head {self.n_head} "
                f"(head size would be {self.n_embd / self.n_head:g})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def preset(cls, name: str, vocab_size: int = 2048, **overrides: Any) -> GPTConfig:
        """A named size from `PRESETS` (`tiny`, `small`, `medium`), fields overridable."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(vocab_size=vocab_size, **{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(fields) - known):
            raise ValueError(f"unknown GPTConfig fields {unknown}; known: {sorted(known)}")
        return cls(**fields)

    def num_params(self) -> int:
        """Parameter count by formula (tied weights once); equals `GPT(self).num_params()`."""
        d, v, b = self.n_embd, self.vocab_size, int(self.bias)
        layer_norm = d + b * d
        block = 2 * layer_norm + (3 * d * d + b * 3 * d) + (d * d + b * d)  # ln1, ln2, attention
        block += (4 * d * d + b * 4 * d) + (4 * d * d + b * d)  # MLP
        embeddings = v * d + self.block_size * d
        head = 0 if self.tie_weights else v * d
        return embeddings + self.n_layer * block + layer_norm + head


# Sizes with the default 2048-token vocabulary (counts from `GPTConfig.num_params`):
# tiny ~1.1M for tests, small ~5.4M trains in minutes on 2 CPU cores (`z train` default),
# medium ~26.8M matches the 27M-parameter GPT of the DeepSpeed comparison; deep ~2.7M is
# tiny's width at 12 layers and 512 tokens, where random-LTD's dropped middle layers pay.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "small": dict(n_layer=6, n_head=8, n_embd=256, block_size=256),
    "medium": dict(n_layer=8, n_head=8, n_embd=512, block_size=1024),
    "deep": dict(n_layer=12, n_head=4, n_embd=128, block_size=512),
}
DEFAULT_SEQ_LEN = 256
"""Tokens per sequence of a run that names none, where the preset's block_size allows."""


def default_seq_len(preset: str) -> int:
    """Tokens per sequence of a `preset` run that names none: `DEFAULT_SEQ_LEN`, or the
    preset's `block_size` when that is shorter (`tiny`: 128)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown GPT preset {preset!r}; choose one of {sorted(PRESETS)}")
    return min(DEFAULT_SEQ_LEN, PRESETS[preset]["block_size"])


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, `n_layer` blocks, final LayerNorm, LM head."""

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 init from a private generator: the same weights for a seed on every rank.

        Weights N(0, 0.02); residual projections N(0, 0.02 / sqrt(2 n_layer)) so the
        residual stream's variance does not grow with depth; biases 0, LayerNorm 1. Under
        ``zcore.zero.Init`` the submodules are partitioned already: each parameter is then
        gathered alone around its init (so at most one is whole at a time) and re-cut.
        """
        from zcore.zero import GatheredParameters

        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        done: set[int] = set()
        for name, param in self.named_parameters():  # tied weights come once
            if id(param) in done:
                continue
            done.add(id(param))
            partitioned = hasattr(param, "_z_owner")
            with GatheredParameters([param], modifier_rank=0, enabled=partitioned):
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(param, 0.0, residual_std, generator=generator)
                elif name.endswith("bias"):
                    nn.init.zeros_(param)
                elif ".ln_" in name:
                    nn.init.ones_(param)
                else:
                    nn.init.normal_(param, 0.0, 0.02, generator=generator)

    def num_params(self) -> int:
        """Distinct parameters' elements (a tied embedding/head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) int64 -> logits (B, T, vocab), mean cross-entropy vs targets (B, T)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} > block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))
        return logits, loss
