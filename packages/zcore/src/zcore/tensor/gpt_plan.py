"""The tensor-parallel plan of ``z train``'s GPT (``ztrain.gpt.GPT``), Megatron's layout.

Per block: the fused ``attn.c_attn`` is column-parallel by blocks (q, k, v each cut by
heads, so rank ``r`` computes heads ``[r h/tp, (r+1) h/tp)``), ``attn.c_proj`` row-parallel;
``mlp.c_fc`` column-parallel, ``mlp.c_proj`` row-parallel. The token embedding is
vocabulary-parallel and the LM head column-parallel over the vocabulary, sharing the
embedding's shard when the two are tied; the loss is
:func:`~zcore.tensor.vocab.vocab_parallel_cross_entropy`, so the full ``(B, T, V)`` logits
never exist: the parallel GPT's ``forward`` returns this rank's ``(B, T, V/tp)`` slice of
them. Position embeddings, LayerNorms and row-parallel biases stay whole on every rank.

With ``sequence_parallel`` (Megatron's), everything between the cut layers (embedding sum,
LayerNorms, dropout, residuals) holds this rank's ``T/tp`` positions: the embedding and the
row cuts reduce-scatter over positions, the column cuts (and the LM head) all-gather them.
The gradient of each whole parameter then covers this rank's positions only, so a hook
sums it over ``tp`` before the engine takes it.

The model is recognized by its config (a ``GPTConfig``: ``n_head``, ``n_embd``,
``vocab_size``, ``block_size``) and its ``transformer.h`` blocks; zcore does not import
``ztrain``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zcore.comm import Comm
from zcore.tensor.cut import cut_by_tp
from zcore.tensor.layers import ColumnParallelLinear, RowParallelLinear
from zcore.tensor.plan import Plan, divides, swap_forward
from zcore.tensor.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

_FIELDS = ("n_head", "n_embd", "vocab_size", "block_size", "n_layer")


def _matches(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    tr = getattr(model, "transformer", None)
    return (
        all(hasattr(cfg, f) for f in _FIELDS)
        and tr is not None
        and hasattr(tr, "h")
        and hasattr(model, "lm_head")
    )


def _problems(model: nn.Module, tp: int) -> list[str]:
    cfg = model.config
    problems: list[str] = []
    divides(problems, "n_head", cfg.n_head, tp, "choose a tp that divides the number of heads")
    divides(problems, "vocab_size", cfg.vocab_size, tp, "pad the vocabulary to a multiple of tp")
    for i, block in enumerate(model.transformer.h):
        mlp = getattr(block, "mlp", None)
        if not all(isinstance(getattr(mlp, f, None), nn.Linear) for f in ("c_fc", "c_proj")):
            problems.append(
                f"transformer.h.{i}.mlp is a {type(mlp).__name__}, not the dense MLP the gpt "
                "plan cuts (c_fc, c_proj); tensor parallelism of MoE layers is not built: "
                "train MoE models with ep and dp instead"
            )
            break
    if getattr(cfg, "dropout", 0.0) and tp > 1:
        problems.append(
            f"dropout {cfg.dropout}: the tensor-parallel GPT has no per-rank dropout streams; "
            "set dropout 0"
        )
    return problems


def attention_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Causal attention over this rank's ``n_head_local`` heads; ``c_attn`` gives their q,
    k and v side by side, ``c_proj`` sums the heads' outputs over ``tp``."""
    heads = self.n_head_local
    qkv = self.c_attn(x)  # (B, T, 3 C/tp): this rank's heads of q, k and v, every position
    B, T, _ = qkv.shape
    width = qkv.shape[-1] // 3
    q, k, v = qkv.split(width, dim=2)
    # (B, heads, T, hs)
    q, k, v = (t.view(B, T, heads, width // heads).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B, T, width)  # (B, T, C/tp)
    return self.resid_dropout(self.c_proj(y))


def _gpt_forward(
    self: nn.Module, idx: torch.Tensor, targets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """idx (B, T) -> this rank's logits (B, T, V/tp), mean cross-entropy vs targets (B, T)."""
    B, T = idx.shape
    if T > self.config.block_size:
        raise ValueError(f"sequence length {T} > block_size {self.config.block_size}")
    comm = self.lm_head.comm
    pos = torch.arange(T, device=idx.device)  # (T,)
    if self.transformer.wte.sequence_parallel:  # this rank's positions: (T/tp,)
        if T % comm.size:
            raise ValueError(
                f"sequence length {T} is not divisible by tp {comm.size}: sequence "
                f"parallelism cuts positions over tp; use a multiple of {comm.size}"
            )
        pos = pos.chunk(comm.size)[comm.rank]
    x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
    for block in self.transformer.h:
        x = block(x)  # (B, T, C)
    logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V/tp)
    loss = None
    if targets is not None:
        flat = logits.view(B * T, -1)
        loss = vocab_parallel_cross_entropy(flat, targets.reshape(B * T), comm)
    return logits, loss


def _sum_partial_grads(model: nn.Module) -> None:
    """Under sequence parallelism each rank's gradient of a parameter every rank holds
    whole (LayerNorms, positions, row biases) covers its own positions: sum it over tp."""
    for name, p in model.named_parameters():
        if cut_by_tp(p) is None and p.requires_grad:
            what = f"all_reduce(tp grad of replicated {name})"

            def hook(g: torch.Tensor, what: str = what) -> torch.Tensor:
                out = g.contiguous().clone()
                model.lm_head.comm.all_reduce(out, what).wait()  # the engine's comm once bound
                return out

            p.register_hook(hook)


def cut_block(block: nn.Module, comm: Comm, name: str, sequence_parallel: bool = False) -> None:
    """Cut one GPT block (``attn.c_attn``/``c_proj``, ``mlp.c_fc``/``c_proj``) over ``comm``
    in place: Megatron's layout (module docstring). Its input and output stay whole (or,
    with ``sequence_parallel``, this rank's ``T/tp`` positions)."""
    sp = sequence_parallel
    at, mlp = block.attn, block.mlp
    c = at.c_attn.in_features
    col, row = ColumnParallelLinear.from_linear, RowParallelLinear.from_linear
    at.c_attn = col(
        at.c_attn, comm, blocks=(c, c, c), name=f"{name}.attn.c_attn", sequence_parallel=sp
    )
    at.c_proj = row(at.c_proj, comm, name=f"{name}.attn.c_proj", sequence_parallel=sp)
    mlp.c_fc = col(mlp.c_fc, comm, name=f"{name}.mlp.c_fc", sequence_parallel=sp)
    mlp.c_proj = row(mlp.c_proj, comm, name=f"{name}.mlp.c_proj", sequence_parallel=sp)
    at.n_head_local = at.n_head // comm.size
    swap_forward(at, attention_forward)


def _apply(model: nn.Module, comm: Comm, sequence_parallel: bool) -> None:
    sp = sequence_parallel
    tr = model.transformer
    tied = model.lm_head.weight is tr.wte.weight
    tr.wte = VocabParallelEmbedding.from_embedding(tr.wte, comm, "transformer.wte")
    tr.wte.sequence_parallel = sp
    model.lm_head = ColumnParallelLinear.from_linear(
        model.lm_head,
        comm,
        weight=tr.wte.weight if tied else None,
        name="lm_head",
        sequence_parallel=sp,
    )
    for i, block in enumerate(tr.h):
        cut_block(block, comm, f"transformer.h.{i}", sp)
    swap_forward(model, _gpt_forward)
    if sp and comm.size > 1:
        _sum_partial_grads(model)


PLAN = Plan("gpt", _matches, _problems, _apply)
