"""The GPT at sequence parallelism (`z train --cp N`): Ulysses or ring attention on `cp`.

The `cp` ranks of a sequence read the same batch (`engine.data_rank` counts them once).
:func:`sequence_parallel` makes a :class:`~ztrain.gpt.GPT` train on this rank's slice of
every sequence: with Ulysses (`sequence_parallel_mode` "ulysses", `--cp-mode ulysses`) a
consecutive slice (`zcore.sequence.even_split`: lengths differ by at most one, so any length
of at least `cp` tokens runs); with ring attention (`--cp-mode ring`) the zig-zag layout
(`zcore.sequence.RingLayout.zigzag`: chunks `r` and `2 cp - 1 - r` of `2 cp`, so every rank
does the same causal work):

* the model keeps this rank's slice of `idx` and of `targets` (already shifted, so the last
  token of a slice predicts the first of the next) and gives the position embedding the
  slice's own positions;
* every block's attention runs through :class:`zcore.sequence.DistributedAttention`, causal
  over the whole sequence (Ulysses: one all-to-all from slices to heads and one back, any
  head count split as evenly as it goes; ring: key/value blocks passed around the ranks);
* the loss whose gradient the engine takes is the slice's mean cross-entropy times
  `cp x L_r / S`, so the engine's gradient average over `dp x cp` is the whole sequence's
  mean; its value is the whole sequence's loss (one scalar all-reduce over `cp`).

The returned logits are the slice's. Parameters and `state_dict` are the GPT's own, so a
checkpoint loads at any `cp` and in `z generate`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zcore.comm import Comm, Mesh
from zcore.sequence import DistributedAttention, RingLayout, SequenceParallelError, even_split
from zcore.sequence.attention import MODES
from zcore.tensor.vocab import vocab_parallel_cross_entropy
from ztrain.train_options import TrainError, TrainOptions


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """`(B, S, h, hs)` causal attention over the whole sequence."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, S, hs)
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return y.transpose(1, 2)


class _Slices(nn.Module):
    """Every rank's slice length of the sequence in flight and the `cp` comm (bound by the
    engine); one per model, shared by its attention layers."""

    def __init__(self) -> None:
        super().__init__()
        self.lens: list[int] = []
        self.layout: RingLayout | None = None
        self.comm: Comm | None = None

    def bind_mesh(self, mesh: Mesh) -> None:
        self.comm = mesh.comm("cp")
        if any(type(a).forward is not _attention_forward for a in self.__dict__["attns"]):
            raise SequenceParallelError(
                "the sequence-parallel GPT was cut over tp after ztrain.gpt_cp.sequence_parallel "
                "(its attention no longer sees the cp slices); cut it first "
                "(zcore.tensor.parallelize(model, spec)), then call sequence_parallel(model)"
            )

    def cut(self, total: int, ring: bool) -> torch.Tensor:
        """Split a `total`-token sequence (zig-zag for the ring, else consecutive); the
        positions this rank holds, `(L_r,)`."""
        if self.comm is None:
            raise SequenceParallelError(
                "the sequence-parallel GPT has no cp collectives: build the engine "
                "(zcore.initialize with sequence_parallel_size) before the first forward"
            )
        cp = self.comm.size
        if total < cp:
            raise SequenceParallelError(
                f"a sequence of {total} tokens cannot be split over cp {cp}: every cp rank "
                f"needs at least one token; use sequences of >= {cp} tokens or a smaller cp"
            )
        lay = (
            RingLayout.zigzag(total, cp) if ring else RingLayout.consecutive(even_split(total, cp))
        )
        self.layout, self.lens = lay, lay.lens
        return lay.index(self.comm.rank)


def _attention_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The GPT's causal attention on this rank's slice `x` `(B, L_r, C)`, every head seeing
    the whole sequence; cut over tp (`n_head_local`), this rank's heads only."""
    B, T, _ = x.shape
    qkv = self.c_attn(x)  # (B, L_r, 3 C/tp)
    width, heads = qkv.shape[-1] // 3, getattr(self, "n_head_local", self.n_head)
    q, k, v = (t.view(B, T, heads, width // heads) for t in qkv.split(width, dim=2))
    p = self.dropout if self.training else 0.0
    y = self.ulysses(q, k, v, dropout_p=p, seq_lens=self.slices.lens, layout=self.slices.layout)
    return self.resid_dropout(self.c_proj(y.contiguous().view(B, T, width)))


def _gpt_forward(
    self: nn.Module, idx: torch.Tensor, targets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """idx (B, S) of the whole sequences -> this rank's logits (B, L_r, vocab; cut over
    tp: vocab / tp) at its positions (`self.slices.layout`) and the loss of the module doc."""
    B, S = idx.shape
    if S > self.config.block_size:
        raise ValueError(f"sequence length {S} > block_size {self.config.block_size}")
    if getattr(self.transformer.wte, "sequence_parallel", False):
        raise SequenceParallelError(
            "cp with tensor parallelism's sequence parallelism (positions cut over tp too) is "
            "not built; cut the model with zcore.tensor.parallelize(..., sequence_parallel=False)"
        )
    pos = self.slices.cut(S, self.transformer.h[0].attn.ulysses.mode == "ring").to(idx.device)
    x = self.transformer.drop(self.transformer.wte(idx[:, pos]) + self.transformer.wpe(pos))
    for block in self.transformer.h:
        x = block(x)  # (B, L_r, C)
    logits = self.lm_head(self.transformer.ln_f(x))  # (B, L_r, vocab)
    if targets is None:
        return logits, None
    flat, labels = logits.view(B * len(pos), -1), targets[:, pos].reshape(-1)
    tp = getattr(self.lm_head, "comm", None)  # cut over tp: logits (B, L_r, vocab / tp)
    if tp is not None:
        mine = vocab_parallel_cross_entropy(flat, labels, tp)
    else:
        mine = F.cross_entropy(flat, labels)
    share = mine * (len(pos) / S)  # this slice's part of the whole sequence's mean
    whole = share.detach().clone()
    comm = self.slices.comm
    assert comm is not None  # cut() refused a model without one
    comm.all_reduce(whole, "cp loss").wait()
    scaled = share * comm.size  # the engine averages gradients over cp: their sum is the mean's
    return logits, scaled + (whole - scaled).detach()


_CLASSES: dict[tuple[type, object], type] = {}


def _subclass(module: nn.Module, forward: object) -> None:
    """Give `module` `forward` through a subclass of its class (state untouched)."""
    cls = type(module)
    sub = _CLASSES.get((cls, forward))
    if sub is None:
        name = f"SequenceParallel{cls.__name__}"
        sub = _CLASSES[(cls, forward)] = type(name, (cls,), {"forward": forward})
    module.__class__ = sub


def sequence_parallel(model: nn.Module, mode: str | None = None) -> nn.Module:
    """Make `model` (a `ztrain.gpt.GPT`, before `zcore.initialize` and after
    `zcore.tensor.parallelize` when cut over tp: heads split over tp, each tp rank's heads
    spanning the cp ranks; the config sets `sequence_parallel_size`) train on this rank's slice of each sequence over the engine
    mesh's `cp` axis; see the module doc. `mode` ("ulysses" or "ring"; None: the config's
    `sequence_parallel_mode`). Returns `model`."""
    slices = _Slices()
    slices.__dict__["attns"] = [block.attn for block in model.transformer.h]  # not submodules
    model.slices = slices
    for block in model.transformer.h:
        block.attn.ulysses = DistributedAttention(_causal, mode=mode)
        block.attn.__dict__["slices"] = slices  # shared: registered once, on the model
        _subclass(block.attn, _attention_forward)
    _subclass(model, _gpt_forward)
    return model


def plan_cp(opts: TrainOptions, world: int) -> int:
    """The `--cp` of `opts` checked against `world` ranks and the other flags (before any
    rank starts); raises `TrainError` naming the numbers and the fix."""
    from ztrain.gpt import PRESETS, default_seq_len

    cp = opts.cp
    if opts.cp_mode not in MODES:
        raise TrainError(f"`--cp-mode {opts.cp_mode}`: pass one of {', '.join(MODES)}")
    if cp == 1:
        if opts.cp_mode != "ulysses":
            raise TrainError(f"`--cp-mode {opts.cp_mode}` splits sequences: add `--cp 2` or more")
        return 1
    if cp < 1:
        raise TrainError(f"`--cp {cp}`: the ranks sharing each sequence, at least 1")
    if opts.moe or opts.dense_twin:
        raise TrainError(
            "`--cp` with `--moe` is not built (the MoE LM's attention does not run through "
            "DistributedAttention); drop `--cp` or `--moe`"
        )
    if opts.pp > 1:
        raise TrainError(
            f"`--cp` with `--pp` is not built (`--cp {cp}`, `--pp {opts.pp}`: the pipeline "
            "stages' blocks do not run DistributedAttention); pass one of them"
        )
    if world % (cp * opts.tp):
        group = cp * opts.tp
        fits = world - world % group
        tp = f" x `--tp {opts.tp}`" if opts.tp > 1 else ""
        raise TrainError(
            f"`--cp {cp}`{tp} does not divide `--nproc {world}`: each sequence takes cp ranks; "
            f"pass `--nproc {group}`" + (f" (or {fits})" if fits > group else "") + ", or a "
            f"`--cp` that divides {world // opts.tp}"
        )
    if opts.preset in PRESETS:
        seq = default_seq_len(opts.preset) if opts.seq_len is None else opts.seq_len
        if seq < cp:
            raise TrainError(
                f"`--seq-len {seq}` is shorter than `--cp {cp}`: every cp rank needs one token "
                f"of each sequence at least; pass `--seq-len` of at least {cp}"
            )
    return cp
