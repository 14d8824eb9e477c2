"""How a LLaMA-family model is cut over ``tp`` tensor-parallel ranks, chosen from its config.

Per decoder layer (Megatron's cut, for serving):

* q/k/v and gate/up are split by output rows (column-parallel): each rank holds whole query
  heads, the whole KV heads those query heads read, and a slice of the MLP width;
* o and down are split by input columns (row-parallel): each rank's output is a partial sum
  over its heads / its MLP slice, summed by one all-reduce each (:attr:`RankShard` says
  which columns);
* the KV cache follows the KV heads: a rank caches only its own KV heads, so one block
  table (the scheduler's) addresses the same block on every rank;
* the embedding stays whole on every rank (a lookup reads a few rows; cutting it by vocab
  would add an all-reduce to every step for no bandwidth), the LM head is cut by vocab rows
  (the largest matrix a decode step reads: SmolLM2's 49152 x 576 is a fifth of the model)
  and rank 0 gathers the logits, where it samples.

Any head count is served, never refused for divisibility. With ``tp <= num_key_value_heads``
either the KV heads are dealt out as evenly as whole heads allow, each with its whole query
group, or the query heads are, each rank holding the KV heads they read (a KV head whose
group is split is held and cached on both ranks, and each attends with the group's other
query slots empty: ``LlamaConfig.attention_pad``), whichever leaves the heaviest rank the
fewer attention weights (q and o per query head, k and v per KV head); the extra heads go to
the last ranks (rank 0 also schedules and samples). SmolLM2's 9 query / 3 KV heads at tp=2:
whole groups would be KV 1/2 and query 3/6 (8 and 16 head-sized blocks), query 4/5 over KV
heads 0-1 and 1-2 weigh 12 and 14. With ``num_key_value_heads <
tp <= num_attention_heads`` each rank holds one KV head, replicated on the ranks that split
its query group (its keys are cached on each of them). Only ``tp > num_attention_heads`` is
refused: a rank would hold no query head. Mixtral's experts are dealt out whole (expert
parallelism inside the tensor-parallel group: the router is on every rank, each rank runs its
experts' share of the tokens and the MoE output is summed by the same all-reduce as a dense
MLP's). The dense MLP width is split as evenly as multiples of :data:`MLP_ALIGN` columns
allow (or of a quantized down projection's group size: :func:`zserve.tp.quantized.mlp_align`):
the all-reduce after the attention is a barrier, so a layer takes the slowest rank's attention
plus the slowest rank's MLP, and extra MLP on the rank with fewer heads would only lengthen the
second (SmolLM2 at tp=2, even MLP against one balancing each layer's weight elements: 32 ms
against 37 ms a decode step, `benchmarks/results/serve-tp.md`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from zserve.model.config import LlamaConfig

MLP_ALIGN = 16
"""The MLP width of a rank is a multiple of this (SIMD-friendly rows), except the last's."""


class TPPlanError(ValueError):
    """The model cannot be cut over the requested ``tp`` (the message names the numbers)."""


@dataclass(frozen=True)
class RankShard:
    """What one tensor-parallel rank holds of every layer (ranges are ``[start, stop)``)."""

    rank: int
    tp: int
    q_heads: tuple[int, int]
    """Query heads."""
    kv_heads: tuple[int, int]
    """Key/value heads (read by exactly those query heads)."""
    mlp: tuple[int, int]
    """Columns of the MLP width (rows of gate/up, columns of down)."""
    vocab: tuple[int, int]
    """Rows of the LM head (columns of the logits)."""
    experts: tuple[int, int] | None
    """Mixtral: the experts (whole) this rank holds; None for a dense MLP."""
    config: LlamaConfig
    """The model as this rank sees it: its heads and MLP width, the whole vocabulary (and
    every expert's router logit)."""

    @property
    def head_dim(self) -> int:
        return self.config.head_dim


def even_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``[0, n)`` in ``parts`` contiguous ranges whose sizes differ by at most one."""
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def _attention_weight(q: tuple[int, int], kv: tuple[int, int]) -> int:
    """A rank's attention projections in head-sized blocks: q and o per query head, k and v
    per KV head."""
    return 2 * (q[1] - q[0]) + 2 * (kv[1] - kv[0])


def head_ranges(
    heads: int, kv_heads: int, tp: int
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each rank's (query heads, KV heads); see the module docstring. A rank whose query heads
    fill only part of a KV head's group attends with that group's other slots empty
    (:func:`attention_pad`)."""
    if tp > heads:
        raise TPPlanError(
            f"tp {tp} > num_attention_heads {heads}: every rank needs at least one query head; "
            f"serve with --tp {heads} or fewer"
        )
    group = heads // kv_heads
    if tp <= kv_heads:
        whole = [((a * group, b * group), (a, b)) for a, b in even_ranges(kv_heads, tp)]
        even = [((a, b), (a // group, -(-b // group))) for a, b in even_ranges(heads, tp)]
        if max(_attention_weight(*r) for r in even) < max(_attention_weight(*r) for r in whole):
            return even
        return whole
    out = []
    for j, (first, last) in enumerate(even_ranges(tp, kv_heads)):  # ranks of KV head j
        for a, b in even_ranges(group, last - first):
            out.append(((j * group + a, j * group + b), (j, j + 1)))
    return out


def attention_pad(
    q_heads: tuple[int, int], kv_heads: tuple[int, int], group: int
) -> tuple[int, int]:
    """The empty query-head slots before and after ``q_heads`` that make the query groups of
    ``kv_heads`` (``group`` query heads each) whole: (0, 0) for whole groups, and for a
    rank holding one KV head, which attends with only its own query heads."""
    if kv_heads[1] - kv_heads[0] == 1:
        return (0, 0)
    return (q_heads[0] - kv_heads[0] * group, kv_heads[1] * group - q_heads[1])


def _mlp_ranges(width: int, tp: int, align: int = MLP_ALIGN) -> list[tuple[int, int]]:
    """``width`` MLP columns in ``tp`` contiguous ranges as even as multiples of ``align``
    allow (the last rank takes the remainder); plainly even where that would leave a rank
    fewer than ``align`` columns."""
    bounds = [round(width * r / tp / align) * align for r in range(tp)] + [width]
    if any(b - a < align for a, b in itertools.pairwise(bounds)):
        return even_ranges(width, tp)
    return [(bounds[i], bounds[i + 1]) for i in range(tp)]


def plan(config: LlamaConfig, tp: int, *, mlp_align: int = MLP_ALIGN) -> list[RankShard]:
    """Every rank's shard of ``config``'s model at ``tp`` ranks; a dense MLP's cuts fall on
    multiples of ``mlp_align`` columns where the balance allows.

    Raises:
        TPPlanError: ``tp < 1``, ``tp > num_attention_heads``, or (Mixtral) ``tp >
            num_local_experts``.
    """
    if tp < 1:
        raise TPPlanError(f"tp must be >= 1; got {tp}")
    c = config
    if c.num_local_experts and tp > c.num_local_experts:
        raise TPPlanError(
            f"tp {tp} > num_local_experts {c.num_local_experts}: each rank holds whole experts; "
            f"serve with --tp {c.num_local_experts} or fewer"
        )
    if tp > c.intermediate_size:
        raise TPPlanError(f"tp {tp} > intermediate_size {c.intermediate_size}; lower --tp")
    heads = head_ranges(c.num_attention_heads, c.num_key_value_heads, tp)
    d = c.head_dim
    experts: list[tuple[int, int] | None] = [None] * tp
    if c.num_local_experts:  # Mixtral: whole experts over the ranks, each expert's MLP whole
        experts = list(even_ranges(c.num_local_experts, tp))
        mlp = [(0, c.intermediate_size)] * tp
    else:
        mlp = _mlp_ranges(c.intermediate_size, tp, mlp_align)
    vocab = even_ranges(c.vocab_size, tp)
    shards = []
    group = c.num_attention_heads // c.num_key_value_heads
    for r, (((q0, q1), (k0, k1)), m) in enumerate(zip(heads, mlp, strict=True)):
        local = dataclasses.replace(
            c,
            num_attention_heads=q1 - q0,
            num_key_value_heads=k1 - k0,
            attention_pad=attention_pad((q0, q1), (k0, k1), group),
            intermediate_size=m[1] - m[0],
            head_dim=d,
        )
        shards.append(RankShard(r, tp, (q0, q1), (k0, k1), m, vocab[r], experts[r], local))
    return shards


def cut_range(proj: str, shard: RankShard, full: LlamaConfig) -> tuple[str, int, tuple[int, int]]:
    """How projection ``proj`` (``q k v o gate up down``) is cut for ``shard``: ``("rows",
    out_features, (a, b))`` (column-parallel: output rows ``a:b``) or ``("cols",
    in_features, (a, b))`` (row-parallel: input columns ``a:b``)."""
    s, c, d = shard, full, full.head_dim
    heads = (s.q_heads[0] * d, s.q_heads[1] * d)
    kv = (s.kv_heads[0] * d, s.kv_heads[1] * d)
    rows = {
        "q": (c.q_size, heads),
        "k": (c.kv_size, kv),
        "v": (c.kv_size, kv),
        "gate": (c.intermediate_size, s.mlp),
        "up": (c.intermediate_size, s.mlp),
    }
    if proj in rows:
        return ("rows", *rows[proj])
    return ("cols", c.q_size, heads) if proj == "o" else ("cols", c.intermediate_size, s.mlp)
