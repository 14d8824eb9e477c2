"""``DistributedAttention``: DeepSpeed-Ulysses over the mesh's ``cp`` axis.

Every ``cp`` rank holds a consecutive slice of each sequence. Before attention, one
all-to-all trades the slices for heads (each rank gets its heads over the whole sequence);
the wrapped local attention runs on them; a second all-to-all trades them back. The result
on each rank is exactly full attention's output for its slice (same math, other order of
nothing: every head's softmax sees the whole sequence).

Unlike DeepSpeed (whose head count must divide the degree, DeepSpeed #4674, and whose
sequence must divide it, #5177), any head count and length run: heads are split as evenly
as they go (:func:`~zcore.sequence.alltoall.even_split`), slices may differ in length, and
with grouped-query attention each rank receives the key/value heads its query heads use,
so a key/value head shared by the query heads of two ranks is sent to both (``cp`` above
the key/value head count works). Key/value heads are expanded to one per local query head
before the local attention, which therefore always sees as many key/value as query heads.

``mode="ring"`` runs ring attention instead (:mod:`zcore.sequence.ring`): queries stay,
key/value blocks travel around the ``cp`` ranks; no head split, so no head-count cap. The
local attention is then not called (the ring computes attention itself, ``causal`` saying
which).

``mode="auto"`` picks per call, from the head layout: Ulysses when the query heads divide
over ``cp`` (every rank then attends as many heads, as DeepSpeed's Ulysses), ring attention
when they do not (an uneven split leaves one rank more heads to attend and hold than the
others, where the ring splits none), and ring for a non-consecutive layout. Only a module
whose local attention is plain causal (or full) softmax attention may choose the ring, since
the ring does not call ``local_attention``: one built with ``ring_ok=False`` (the default:
its local attention may add masks or biases the ring would skip) takes Ulysses under
``auto``. :func:`zcore.sequence.hf.parallelize` builds its module with ``ring_ok=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zcore.comm import Comm, Mesh
from zcore.sequence.alltoall import even_split, heads_to_seq, seq_to_heads, starts
from zcore.sequence.ring import RingLayout, ring_attention

MODES = ("ulysses", "ring", "auto")
"""Sequence-parallel attention modes (``sequence_parallel_mode``)."""


class SequenceParallelError(ValueError):
    """Inputs Ulysses cannot split; the message names the numbers and the fix."""


def head_plan(
    q_heads: int, kv_heads: int, cp: int
) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]]]:
    """Per ``cp`` rank: its query-head count, its query-head range and the key/value-head
    range those query heads use (ranges of neighbours may share a key/value head)."""
    if kv_heads < 1 or q_heads % kv_heads:
        raise SequenceParallelError(
            f"{q_heads} query heads cannot share {kv_heads} key/value heads evenly; "
            "grouped-query attention needs a key/value head count dividing the query heads"
        )
    group = q_heads // kv_heads
    counts = even_split(q_heads, cp)
    q_ranges = [(a, a + n) for a, n in zip(starts(counts), counts, strict=True)]
    kv_ranges = [(a // group, (b - 1) // group + 1) if b > a else (0, 0) for a, b in q_ranges]
    return counts, q_ranges, kv_ranges


class DistributedAttention(nn.Module):
    """Ulysses attention over ``axis`` (DeepSpeed's ``DistributedAttention``, batch first).

    Args:
        local_attention: ``(q, k, v, *args, **kwargs) -> out`` on ``(b, S, h, d)`` tensors
            with as many key/value heads as query heads, returning ``(b, S, h, d)``.
        sequence_process_group: the :class:`~zcore.comm.Comm` of the ranks sharing each
            sequence; None: taken from the engine's mesh (``bind_mesh``) as ``axis``.
        scatter_idx, gather_idx: DeepSpeed's names for the head and sequence dimensions;
            only the batch-first layout ``(2, 1)`` is supported.
        axis: the mesh axis (``"cp"``).
        mode: ``"ulysses"`` (all-to-all over heads), ``"ring"`` (key/value blocks passed
            around the ranks; see :mod:`zcore.sequence.ring`) or ``"auto"`` (see the module
            doc); None: the config's ``sequence_parallel_mode`` (``zcore.initialize`` sets
            it), else ulysses.
        causal: ring mode only: causal over the whole sequence (the Ulysses mode leaves
            masking to ``local_attention``).
        ring_ok: ``local_attention`` is plain softmax attention (causal as ``causal`` says,
            scale and zero dropout its only options), so ``auto`` may run the ring in its
            place.
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor],
        sequence_process_group: Comm | None = None,
        scatter_idx: int = 2,
        gather_idx: int = 1,
        *,
        axis: str = "cp",
        mode: str | None = None,
        causal: bool = True,
        ring_ok: bool = False,
    ) -> None:
        super().__init__()
        if mode is not None and mode not in MODES:
            raise SequenceParallelError(
                f"sequence-parallel mode {mode!r} is not one of {MODES}; pass mode='ulysses' "
                "(heads split over cp), mode='ring' (key/value blocks passed around cp) or "
                "mode='auto' (Ulysses where the heads divide over cp, else the ring)"
            )
        if (scatter_idx, gather_idx) != (2, 1):
            raise SequenceParallelError(
                f"scatter_idx {scatter_idx}, gather_idx {gather_idx}: zcore's Ulysses takes "
                "(batch, seq, heads, head_dim) tensors; pass scatter_idx=2, gather_idx=1"
            )
        self.local_attn = local_attention
        self.comm = sequence_process_group
        self.axis = axis
        self.mode = mode or "ulysses"
        self.chosen = mode is not None
        """Whether ``mode`` was given (else the config's ``sequence_parallel_mode`` rules)."""
        self.causal = causal
        self.ring_ok = ring_ok

    def active_mode(self, q_heads: int, cp: int, layout: RingLayout | None = None) -> str:
        """The mode a call with ``q_heads`` local query heads over ``cp`` ranks runs:
        ``mode`` itself, or under ``"auto"`` the choice the module doc describes."""
        if self.mode != "auto":
            return self.mode
        if not self.ring_ok:
            return "ulysses"
        if layout is not None and layout != RingLayout.consecutive(layout.lens):
            return "ring"
        return "ulysses" if q_heads % cp == 0 else "ring"

    def bind_mesh(self, mesh: Mesh) -> None:
        """Take the ``axis`` collectives of the engine's mesh (the engine calls this)."""
        if self.comm is None:
            self.comm = mesh.comm(self.axis)

    def _comm(self) -> Comm:
        if self.comm is None:
            raise SequenceParallelError(
                f"DistributedAttention over {self.axis!r} has no collectives: pass "
                "sequence_process_group=mesh.comm('cp'), or build the engine first "
                "(zcore.initialize binds every layer to its mesh)"
            )
        return self.comm

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *args: Any,
        seq_lens: Sequence[int] | None = None,
        layout: RingLayout | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """This rank's slice ``(b, L, h, d)`` of the attention output.

        ``query`` is ``(b, L, h_q, d)``, ``key``/``value`` ``(b, L, h_kv, d)``: this rank's
        slice. ``seq_lens`` gives every rank's slice length (default: all equal to ``L``).
        ``args``/``kwargs`` go to the local attention unchanged; in ring mode only
        ``scale=`` and a zero ``dropout``/``dropout_p`` are taken, and ``layout`` may say
        which positions each rank holds (default: consecutive slices of ``seq_lens``).
        """
        comm = self._comm()
        cp = comm.size
        if seq_lens is None:
            seq_lens = [query.shape[1]] * cp if layout is None else layout.lens
        lens = [int(n) for n in seq_lens]
        if len(lens) != cp or lens[comm.rank] != query.shape[1] or min(lens) < 1:
            raise SequenceParallelError(
                f"slice lengths {lens} do not fit {cp} cp ranks with this rank's "
                f"{query.shape[1]} tokens at cp rank {comm.rank}; every rank needs >= 1 token: "
                "the sequence must be at least as long as sequence_parallel_size"
            )
        mode = self.active_mode(query.shape[2], cp, layout)
        if layout is not None and mode != "ring" and layout != RingLayout.consecutive(lens):
            raise SequenceParallelError(
                f"Ulysses takes consecutive slices, not the layout {layout.runs}; use "
                "RingLayout.consecutive(seq_lens) or mode='ring'"
            )
        if mode == "ring":
            return self._ring(
                query, key, value, comm, layout or RingLayout.consecutive(lens), args, kwargs
            )
        counts, q_ranges, kv_ranges = head_plan(query.shape[2], key.shape[2], cp)
        ranges = [q_ranges, kv_ranges, kv_ranges]
        q, k, v = seq_to_heads([query, key, value], comm, lens, ranges, "ulysses qkv")
        (qa, qb), (ka, _) = q_ranges[comm.rank], kv_ranges[comm.rank]
        if qb > qa:
            group = query.shape[2] // key.shape[2]
            pick = torch.tensor([h // group - ka for h in range(qa, qb)], device=k.device)
            if not (key.shape[2] == query.shape[2] and kv_ranges[comm.rank] == (qa, qb)):
                k, v = k.index_select(2, pick), v.index_select(2, pick)
            out = self.local_attn(q, k, v, *args, **kwargs)
        else:  # more ranks than query heads: this rank attends nothing
            out = q
        return heads_to_seq(out, comm, lens, counts, "ulysses out")

    def _ring(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        comm: Comm,
        layout: RingLayout,
        args: tuple,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        dropout = kwargs.pop("dropout", kwargs.pop("dropout_p", 0.0))
        scale = kwargs.pop("scale", None)
        if args or kwargs or dropout:
            raise SequenceParallelError(
                f"ring attention takes scale= and no dropout; got positional {len(args)} "
                f"argument(s), keywords {sorted(kwargs)}, dropout {dropout}: set the "
                "attention dropout to 0 (or use mode='ulysses', which calls local_attention)"
            )
        if len(layout.runs) != comm.size or layout.lens[comm.rank] != query.shape[1]:
            raise SequenceParallelError(
                f"ring layout of {layout.lens} positions per rank does not fit {comm.size} cp "
                f"ranks with this rank's {query.shape[1]} tokens at cp rank {comm.rank}; build "
                "it with RingLayout.consecutive(seq_lens) or RingLayout.zigzag(total, cp)"
            )
        return ring_attention(query, key, value, comm, layout, causal=self.causal, scale=scale)


def configure_modes(model: nn.Module, mode: str) -> None:
    """Give every :class:`DistributedAttention` of ``model`` built without a ``mode`` the
    config's ``sequence_parallel_mode`` ``mode``; one built with another mode is an error
    naming both, unless the config's mode is ``"auto"``, which leaves a chosen mode alone
    (the engine calls this once, at ``zcore.initialize``)."""
    for name, m in model.named_modules():
        if not isinstance(m, DistributedAttention):
            continue
        if m.chosen and mode == "auto":
            continue
        if m.chosen and m.mode != mode:
            raise SequenceParallelError(
                f"`{name}` is DistributedAttention(mode={m.mode!r}) but the config sets "
                f"sequence_parallel_mode {mode!r}; drop mode= (the config then decides) or "
                f"set sequence_parallel_mode to {m.mode!r}"
            )
        m.mode = mode
