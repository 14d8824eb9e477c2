"""A Mixtral-architecture LM for `z train --moe`, and its dense twin.

LLaMA-style blocks (RMSNorm, rotary attention, no biases) whose feed-forward is either a
`zmoe.MoE` of SwiGLU experts (`w1` gate, `w3` up, `w2` down: Mixtral's names) with top-k
softmax routing, or one dense SwiGLU of `k x expert_ffn` (the same active parameters per
token). The module names are transformers' `MixtralForCausalLM`'s (`model.layers.{i}.
self_attn.q_proj`, `block_sparse_moe.experts.{e}.w1`, ...) so the export
(`mixtral_export.py`) renames only the router (`gate.wg` -> `gate`).

The math is Mixtral's where it matters for export: RMSNorm in fp32 times the weight, the
rotary embedding of `rotate_half`, `scaled_dot_product_attention` (causal, scale
1/sqrt(head_dim)), router softmax in fp32, top-k, weights renormalised to sum to 1 (zmoe
top-2 without the 2nd-expert Gumbel sampling; k >= 3 through its top-k path).

`forward(idx, targets)` returns `(logits, loss)`: in training `loss` is the cross-entropy
plus `aux_loss_coef x` the sum of the MoE layers' load-balancing losses (DeepSpeed adds
each layer's `l_aux` the same way); in eval it is the cross-entropy alone. `last_ce` is the
cross-entropy of the last forward, `moe_layers()` the layers whose `last_stats` the
recipe's metrics read.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import zmoe

ARCH = "mixtral"
"""The `arch` key of this model's `model.json` (a GPT's has none)."""
LAYER_PATTERNS = ("every", "every-other")


def swiglu_ffn(n_embd: int, k: int) -> int:
    """Expert hidden size: LLaMA's 8/3 x d split over the k active experts, rounded up to 32."""
    return 32 * math.ceil(8 * n_embd / 3 / k / 32)


def layer_experts(n_layer: int, pattern: str, experts: tuple[int, ...]) -> tuple[int, ...]:
    """Experts of each layer (0: dense). `pattern` picks the MoE layers (`every`, or
    `every-other`: layers 1, 3, 5, ... as DeepSpeed's expert interval 2); `experts` has one
    count, or several that split the MoE layers into equal consecutive groups (PR-MoE's
    pyramid: `4,8` gives the first half 4 experts and the second half 8)."""
    if pattern not in LAYER_PATTERNS:
        raise ValueError(f"MoE layer pattern {pattern!r} is not one of {LAYER_PATTERNS}")
    moe = [i for i in range(n_layer) if pattern == "every" or i % 2 == 1]
    if not moe:
        raise ValueError(f"`{pattern}` picks no MoE layer out of {n_layer}")
    if len(moe) % len(experts):
        raise ValueError(
            f"{len(experts)} expert counts {list(experts)} do not split the {len(moe)} MoE "
            f"layers (`{pattern}` of {n_layer}) into equal groups; give 1 or a divisor of "
            f"{len(moe)} counts"
        )
    per = len(moe) // len(experts)
    counts = [0] * n_layer
    for j, i in enumerate(moe):
        counts[i] = experts[j // per]
    return tuple(counts)


@dataclass(frozen=True)
class MoELMConfig:
    """Shape of a `MoELM`; `to_dict`/`from_dict` are its `model.json` (with `arch`)."""

    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    """Longest context (the rotary tables' length)."""
    expert_ffn: int
    """Hidden size of one SwiGLU expert; a dense layer's is `k x expert_ffn`."""
    experts: tuple[int, ...]
    """Experts of each layer; 0 makes the layer dense. All 0: the dense twin."""
    k: int = 2
    """Experts per token (and the dense width multiple)."""
    capacity_factor: float = 1.0
    """Capacity path (`dropless` False): slots per expert = k x tokens / experts x this."""
    dropless: bool = False
    ep_size: int = 1
    """Expert-parallel ranks (a runtime choice: loading for inference sets it to 1)."""
    aux_loss_coef: float = 0.01
    router: str = "softmax"
    use_residual: bool = False
    aux_loss_free_bias: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_weights: bool = False
    """Always False (Mixtral's `tie_word_embeddings`); `export_dir` reads it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "experts", tuple(int(e) for e in self.experts))
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size", "expert_ffn"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"n_embd {self.n_embd} / n_head {self.n_head} must be an even head size"
            )
        if len(self.experts) != self.n_layer:
            raise ValueError(f"{len(self.experts)} expert counts for {self.n_layer} layers")
        for e in self.experts:
            if e and not 1 <= self.k <= e:
                raise ValueError(f"top-k {self.k} must be between 1 and the {e} experts of a layer")
            if e % self.ep_size:
                raise ValueError(
                    f"{e} experts in a layer do not divide over ep {self.ep_size}; choose an "
                    f"ep that divides every layer's count {sorted(set(self.experts) - {0})}"
                )
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor}")

    @property
    def is_dense(self) -> bool:
        return not any(self.experts)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return {"arch": ARCH, **dataclasses.asdict(self), "experts": list(self.experts)}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> MoELMConfig:
        fields = {k: v for k, v in fields.items() if k != "arch"}
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(fields) - known):
            raise ValueError(f"unknown MoELMConfig fields {unknown}; known: {sorted(known)}")
        return cls(**fields)

    def num_params(self, active: bool = False) -> int:
        """Parameters by formula; `active`: those one token uses (k experts per MoE layer)."""
        d, ffn = self.n_embd, self.expert_ffn
        total = 2 * self.vocab_size * d + d  # embedding, head, final norm
        for e in self.experts:
            total += 4 * d * d + 2 * d  # attention, two norms
            if e:
                total += d * e + 3 * d * ffn * (self.k if active else e)
            else:
                total += 3 * d * ffn * self.k
        return total


class RMSNorm(nn.Module):
    """Mixtral's: `weight * (x / sqrt(mean(x^2) + eps))`, the normalising in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (length, head_dim) as transformers' default rotary embedding computes them."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: MoELMConfig) -> None:
        super().__init__()
        d, self.n_head = config.n_embd, config.n_head
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, nh, T, hs)
        q, k, v = (
            p(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    """`w2(silu(w1 x) * w3 x)`: one Mixtral expert (`MixtralBlockSparseTop2MLP`)."""

    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)
        self.w3 = nn.Linear(d, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + ffn(norm(x)); ffn a `zmoe.MoE` or a dense SwiGLU."""

    def __init__(self, config: MoELMConfig, experts: int) -> None:
        super().__init__()
        d = config.n_embd
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.block_sparse_moe: zmoe.MoE | None = None
        self.mlp: SwiGLU | None = None
        if experts:
            self.block_sparse_moe = zmoe.MoE(
                d,
                SwiGLU(d, config.expert_ffn),
                num_experts=experts,
                ep_size=config.ep_size,
                k=config.k,
                capacity_factor=config.capacity_factor,
                eval_capacity_factor=config.capacity_factor,
                drop_tokens=not config.dropless,
                use_residual=config.use_residual,
                top2_2nd_expert_sampling=False,  # Mixtral's top-2 is the two best
                router=config.router,
                aux_loss_free_bias=config.aux_loss_free_bias,
            )
        else:
            self.mlp = SwiGLU(d, config.k * config.expert_ffn)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        if self.block_sparse_moe is None:
            assert self.mlp is not None
            return x + self.mlp(h), None
        out, l_aux, _ = self.block_sparse_moe(h)
        return x + out, l_aux


class MoELM(nn.Module):
    """Embedding, `n_layer` decoder layers, final RMSNorm, untied LM head."""

    def __init__(self, config: MoELMConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.n_embd),
                layers=nn.ModuleList(DecoderLayer(config, e) for e in config.experts),
                norm=RMSNorm(config.n_embd, config.rms_norm_eps),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.head_dim, config.block_size, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.last_ce: float | None = None
        """The cross-entropy of the last forward with targets (no aux loss)."""
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """N(0, 0.02), residual outputs (`o_proj`, `w2`) N(0, 0.02 / sqrt(2 n_layer)), norms 1.

        Each parameter draws from a generator seeded by (seed, its name), so an expert's
        weights depend on its global index, not on which rank holds it (any `ep_size`).
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, param in self.named_parameters():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(("o_proj.weight", "w2.weight")):
                nn.init.normal_(param, 0.0, residual_std, generator=g)
            else:
                nn.init.normal_(param, 0.0, 0.02, generator=g)

    def moe_layers(self) -> list[zmoe.MoE]:
        return [m.block_sparse_moe for m in self.model.layers if m.block_sparse_moe is not None]

    def num_params(self) -> int:
        """This rank's parameters (all experts at ep 1)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) int64 -> logits (B, T, vocab), loss (see the module docstring)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} > block_size {self.config.block_size}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hs)
        x = self.model.embed_tokens(idx)  # (B, T, C)
        aux = []
        for layer in self.model.layers:
            x, l_aux = layer(x, cos, sin)
            if l_aux is not None:
                aux.append(l_aux)
        logits = self.lm_head(self.model.norm(x))  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(B * T))
        self.last_ce = loss.item()
        if self.training and aux and self.config.aux_loss_coef:
            loss = loss + self.config.aux_loss_coef * torch.stack(aux).sum()
        return logits, loss
