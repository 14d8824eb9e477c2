"""Ulysses for Hugging Face LLaMA-family causal LMs (LLaMA, Mistral, Qwen2, SmolLM2).

:func:`parallelize` makes a transformers ``*ForCausalLM`` train on slices of each
sequence across the ``cp`` ranks:

* every ``cp`` rank is given the *whole* batch (the ranks of a sequence read the same data:
  ``engine.data_rank`` counts them once); a forward pre-hook keeps this rank's positions of
  ``input_ids``, ``position_ids`` (the slice's own positions, so rotary embeddings see where
  the slice sits) and of the labels *shifted on the whole sequence* (the last token of a
  slice predicts the first of the next one): a consecutive slice for Ulysses, the zig-zag
  layout for ring attention (:meth:`RingLayout.zigzag`: chunks ``r`` and ``2 cp - 1 - r`` of
  ``2 cp``, so every rank does the same causal work);
* attention runs as the implementation ``"zcore_ulysses"``, registered with the
  ``AttentionInterface`` the model's attention layers dispatch through: the model's
  projections hand it this slice's q/k/v and :class:`~zcore.sequence.DistributedAttention`
  runs torch's sdpa, causal over the whole sequence, on this rank's heads (or, with
  ``sequence_parallel_mode`` "ring", ring attention over the zig-zag layout; with "auto",
  the default, the ring where the query heads do not divide over ``cp`` and the attention
  has no dropout, Ulysses otherwise);
* the loss of each rank is ``cp x (its real tokens' summed loss) / (real tokens of the
  whole sequence)``, so the engine's gradient average over ``dp x cp`` is the sum over the
  slices; the value each rank returns is the whole sequence's loss (one scalar all-reduce).

Refused at the start, naming the fix: another attention implementation than sdpa/eager
(flash, flex: their kernels see only a slice), a model whose attention does not go through
transformers' ``AttentionInterface``, a padding mask with zeros, a KV cache, a sequence
shorter than ``cp``, sliding-window attention shorter than the sequence.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zcore.comm import Comm, Mesh
from zcore.sequence.alltoall import even_split
from zcore.sequence.attention import DistributedAttention, SequenceParallelError
from zcore.sequence.ring import RingLayout

NAME = "zcore_ulysses"
"""The attention implementation :func:`parallelize` registers and sets."""
WRAPPABLE = ("sdpa", "eager", None)


@dataclass
class _State:
    """What the attention function needs on every call, per model."""

    attention: DistributedAttention
    seq_lens: list[int] = field(default_factory=list)
    layout: RingLayout | None = None
    q_heads: int = 0
    """Query heads of each attention layer on this rank (after a tensor-parallel cut), read
    at the first forward; 0 before it."""


def _local_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None, dropout: float
) -> torch.Tensor:
    """``(b, S, h, d)`` causal attention over the whole sequence (as many k/v as q heads)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        dropout_p=dropout,
        is_causal=True,
        scale=scale,
    )
    return out.transpose(1, 2)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``(b, h, L, d)`` of this rank's
    slice in, ``(b, L, h, d)`` out. ``attention_mask`` is None here (transformers builds no
    mask for an implementation without a mask function; the batch hook refused padding)."""
    state: _State | None = getattr(module, "_z_ulysses", None)
    if state is None:
        raise SequenceParallelError(
            f"{type(module).__name__} runs attention {NAME!r} but was not prepared for it; "
            "call zcore.sequence.hf.parallelize(model, mesh) on the model"
        )
    out = state.attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        seq_lens=state.seq_lens,
        layout=state.layout,
        scale=scaling,
        dropout=dropout,
    )
    return out, None


def _local_q_heads(model: nn.Module) -> int:
    """Query heads of the model's first attention layer as its projection holds them (a
    tensor-parallel cut keeps a share), or 0 where the layout is not readable."""
    for m in model.modules():
        proj, dim = getattr(m, "q_proj", None), getattr(m, "head_dim", None)
        if hasattr(m, "num_key_value_groups") and proj is not None and dim:
            return int(getattr(proj, "out_features", 0)) // int(dim)
    return 0


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's attention layers, once :data:`NAME` is registered with the
    ``AttentionInterface`` they dispatch through (the model's own: zcore does not import
    transformers)."""
    found = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    interfaces = [
        getattr(sys.modules[type(m).__module__], "ALL_ATTENTION_FUNCTIONS", None) for m in found
    ]
    if not found or any(i is None or not hasattr(i, "register") for i in interfaces):
        raise SequenceParallelError(
            f"{type(model).__name__}'s attention cannot be wrapped for sequence parallelism: "
            "it does not dispatch through transformers' AttentionInterface; use a "
            "LLaMA-family model (LLaMA, Mistral, Qwen2) or sequence_parallel_size 1"
        )
    for interface in interfaces:
        interface.register(NAME, ulysses_attention)
    return found


def _comm(where: Mesh | Comm) -> Comm:
    return where.comm("cp") if isinstance(where, Mesh) else where


def parallelize(model: nn.Module, mesh: Mesh | Comm, mode: str | None = None) -> nn.Module:
    """Train ``model`` (a transformers causal LM) with each sequence split over ``mesh``'s
    ``cp`` axis (or the given :class:`Comm`); see the module doc. ``mode``: ``"ulysses"``,
    ``"ring"`` or ``"auto"`` (:class:`DistributedAttention`'s); None: the ``sequence_parallel_mode`` of
    the config ``zcore.initialize`` is given. Returns ``model``."""
    comm = _comm(mesh)
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in WRAPPABLE and impl != NAME:
        raise SequenceParallelError(
            f"attention implementation {impl!r} cannot be wrapped by Ulysses (its kernel would "
            f"see one slice of the sequence); load the model with attn_implementation='sdpa'"
        )
    attention = DistributedAttention(_local_sdpa, comm, mode=mode, causal=True, ring_ok=True)
    state = _State(attention)
    model.z_sequence_attention = state.attention  # a submodule (no state): the engine sets its mode
    for m in _attention_modules(model):
        m._z_ulysses = state  # type: ignore[assignment]
    config._attn_implementation = NAME
    model.register_forward_pre_hook(_SliceBatch(comm, state, config), with_kwargs=True)
    model.register_forward_hook(_WholeLoss(comm), with_kwargs=True)
    return model


class _SliceBatch:
    """Forward pre-hook: the whole batch in, this rank's slice (and shifted labels) out."""

    def __init__(self, comm: Comm, state: _State, config: Any) -> None:
        self.comm, self.state, self.config = comm, state, config

    def active_mode(self) -> str:
        """The attention this step runs (``auto`` resolved: Ulysses with attention dropout,
        which the ring does not take; else the head layout decides)."""
        attention = self.state.attention
        if attention.mode == "auto" and getattr(self.config, "attention_dropout", 0.0):
            return "ulysses"
        return attention.active_mode(self.state.q_heads or self.comm.size, self.comm.size)

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            kwargs = {"input_ids": args[0], **kwargs}
        ids = kwargs.get("input_ids")
        if ids is None:
            raise SequenceParallelError("sequence parallelism needs input_ids (not inputs_embeds)")
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise SequenceParallelError(
                "a KV cache with sequence parallelism: cp splits training sequences; "
                "generate without it (sequence_parallel_size 1)"
            )
        cp, total = self.comm.size, ids.shape[1]
        if not self.state.q_heads:
            self.state.q_heads = _local_q_heads(model)
        if total < cp:
            raise SequenceParallelError(
                f"a sequence of {total} tokens cannot be split over sequence_parallel_size "
                f"{cp}: each cp rank needs at least one token; use sequences of >= {cp} "
                f"tokens or a smaller sequence_parallel_size"
            )
        window = getattr(self.config, "sliding_window", None)
        if window and total > window and getattr(self.config, "use_sliding_window", True):
            raise SequenceParallelError(
                f"sliding-window attention ({window} tokens) on a {total}-token sequence: "
                "Ulysses attention here is full causal; set sliding_window=None or shorter "
                "sequences"
            )
        ring = self.active_mode() == "ring"
        lay = (
            RingLayout.zigzag(total, cp) if ring else RingLayout.consecutive(even_split(total, cp))
        )
        self.state.seq_lens, self.state.layout = lay.lens, lay
        mine = lay.index(self.comm.rank, ids.device)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(total, device=ids.device).expand(ids.shape[0], total)
        out = dict(kwargs, input_ids=ids[:, mine], position_ids=positions[:, mine])
        out["use_cache"] = False
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise SequenceParallelError(
                "a padding mask with zeros: Ulysses attention here is causal over whole "
                "sequences; pack or trim the batch (mark ignored tokens with labels -100)"
            )
        out.pop("attention_mask", None)  # all ones: the causal mask alone
        labels = kwargs.get("labels")
        if labels is not None:
            shifted = kwargs.get("shift_labels")
            if shifted is None:
                shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
            real = kwargs.get("num_items_in_batch")
            if real is None:
                real = (shifted != -100).sum()
            out["labels"] = out["shift_labels"] = shifted[:, mine.to(shifted.device)]
            out["num_items_in_batch"] = real / cp  # loss = cp x this slice's sum / real tokens
        return (), out


class _WholeLoss:
    """Forward hook: each rank returns the whole sequence's loss; its gradient stays the
    rank's own share (scaled by ``cp``, see the module doc)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        loss = getattr(output, "loss", None)
        if loss is None or self.comm.size == 1:
            return output
        total = loss.detach().clone()
        self.comm.all_reduce(total, "ulysses loss").wait()
        output.loss = loss + (total / self.comm.size - loss).detach()
        return output
