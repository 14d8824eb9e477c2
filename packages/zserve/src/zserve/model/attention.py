"""Ragged paged attention: the packed tokens of many sequences attend to their own
sequence's keys/values, read from the blocked KV cache through each block table.

A ragged batch packs chunks back to back: chunk ``c`` holds ``query_lens[c]`` tokens at
positions ``start_positions[c] ..`` of its sequence, and token ``i`` of it attends causally
to keys ``0 .. start_positions[c] + i`` (its own keys are written to the cache first).

* :func:`paged_attention_reference` — the readable definition: per token, gather its
  keys slot by slot, softmax in fp32. Tests hold the fast paths to it.
* :func:`ragged_paged_attention` — the CPU/torch path: every 1-token chunk (decodes)
  runs in one padded, masked SDPA call with the block tables gathered block-wise; every
  longer chunk (prompt chunks) runs one SDPA call. The :class:`AttentionPlan` (slots,
  gathered block ids, masks) is built once per forward and shared by all layers.

Shapes: ``q (T, num_heads, head_dim)``, ``k``/``v`` ``(T, num_kv_heads, head_dim)``,
caches ``(num_blocks, block_size, num_kv_heads, head_dim)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSpan:
    """A multi-token chunk of the packed batch."""

    row: int
    """Packed index of the chunk's first token."""
    num_tokens: int
    """Tokens in the chunk."""
    start_pos: int
    """Sequence position of the first token (= keys already cached before it)."""
    blocks: torch.Tensor
    """int64 ``(ceil((start_pos + num_tokens) / block_size),)`` physical block ids."""
    mask: torch.Tensor | None
    """bool ``(num_tokens, start_pos + num_tokens)``: key j visible to query i; None = causal."""


@dataclass(frozen=True)
class AttentionPlan:
    """Everything attention needs about one ragged batch, built once, used by every layer."""

    num_tokens: int
    """T: packed tokens in the forward."""
    positions: torch.Tensor
    """int64 ``(T,)``: each token's position in its sequence (for rotary embeddings)."""
    slots: torch.Tensor
    """int64 ``(T,)``: flat cache slot each token's key/value is written to."""
    prefills: tuple[PrefillSpan, ...]
    """The chunks of 2+ tokens."""
    decode_rows: torch.Tensor
    """int64 ``(D,)``: packed indices of the 1-token chunks."""
    decode_blocks: torch.Tensor
    """int64 ``(D, max_blocks)``: their block tables, padded with block 0."""
    decode_lens: torch.Tensor
    """int32 ``(D,)``: keys each 1-token chunk attends to (its position + 1)."""
    decode_mask: torch.Tensor
    """bool ``(D, 1, 1, max_blocks * block_size)``: key slot j holds a visible key."""


def plan_ragged_attention(
    query_lens: Sequence[int],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionPlan:
    """Build the :class:`AttentionPlan` of a batch (inputs already validated by the runner)."""
    positions: list[int] = []
    slots: list[int] = []
    prefills: list[PrefillSpan] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    row = 0
    for n, start, table in zip(query_lens, start_positions, block_tables, strict=True):
        end = start + n
        nb = -(-end // block_size)
        used = list(table[:nb])
        for p in range(start, end):
            slots.append(used[p // block_size] * block_size + p % block_size)
        positions.extend(range(start, end))
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(used)
            decode_lens.append(end)
        else:
            mask = None
            if start:
                # Query i (position start + i) sees keys 0 .. start + i.
                q_pos = torch.arange(start, end, device=device)[:, None]
                mask = torch.arange(end, device=device)[None, :] <= q_pos
            blocks = torch.tensor(used, dtype=torch.int64, device=device)
            prefills.append(PrefillSpan(row, n, start, blocks, mask))
        row += n
    max_nb = max((len(t) for t in decode_tables), default=0)
    padded = [t + [0] * (max_nb - len(t)) for t in decode_tables]
    lens = torch.tensor(decode_lens, dtype=torch.int32, device=device)
    key_pos = torch.arange(max_nb * block_size, device=device)
    return AttentionPlan(
        num_tokens=row,
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slots=torch.tensor(slots, dtype=torch.int64, device=device),
        prefills=tuple(prefills),
        decode_rows=torch.tensor(decode_rows, dtype=torch.int64, device=device),
        decode_blocks=torch.tensor(padded, dtype=torch.int64, device=device).view(
            len(padded), max_nb
        ),
        decode_lens=lens,
        decode_mask=(key_pos[None, :] < lens[:, None]).view(len(padded), 1, 1, max_nb * block_size),
    )


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``cache[blocks]`` flattened over blocks: ``(..., nb * block_size, kv_heads, head_dim)``.

    ``index_select`` rather than advanced indexing: on a CPU shared with other work the
    latter's parallel kernel measured ~2000x slower for a decode's few blocks.
    """
    g = cache.index_select(0, blocks.reshape(-1))  # (N * nb, block_size, kv_heads, d)
    return g.view(*blocks.shape[:-1], -1, *cache.shape[2:])


def prefill_attention_(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> None:
    """Attention of the plan's multi-token chunks, written into their rows of ``out``."""
    group = q.shape[1] // k.shape[1]
    for span in plan.prefills:
        rows = slice(span.row, span.row + span.num_tokens)
        q_s = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, n, d)
        if span.start_pos == 0:
            k_s, v_s = k[rows], v[rows]  # (n, kv_heads, d): nothing older to read
        else:
            ctx = span.start_pos + span.num_tokens
            k_s = _gather(k_cache, span.blocks)[:ctx]  # (ctx, kv_heads, d)
            v_s = _gather(v_cache, span.blocks)[:ctx]
        o = F.scaled_dot_product_attention(
            q_s,
            k_s.transpose(0, 1).unsqueeze(0),  # (1, kv_heads, ctx, d)
            v_s.transpose(0, 1).unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[rows] = o[0].transpose(0, 1)


def decode_attention_(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> None:
    """Attention of the plan's 1-token chunks, in one padded SDPA call, into ``out``."""
    num_decodes = plan.decode_rows.numel()
    if not num_decodes:
        return
    heads, d = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    # GQA without repeating keys: the `group` query heads sharing a KV head become
    # that head's `group` query rows, so each key is read once per KV head.
    q_d = q.index_select(0, plan.decode_rows).view(num_decodes, kv_heads, heads // kv_heads, d)
    k_d = _gather(k_cache, plan.decode_blocks).transpose(1, 2)  # (D, kv_heads, L, d)
    v_d = _gather(v_cache, plan.decode_blocks).transpose(1, 2)
    o = F.scaled_dot_product_attention(q_d, k_d, v_d, attn_mask=plan.decode_mask, scale=scale)
    out.index_copy_(0, plan.decode_rows, o.reshape(num_decodes, heads, d))


def ragged_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Attention of the packed queries ``q (T, H, d)`` → ``(T, H, d)``.

    ``k``/``v`` are this forward's own keys/values ``(T, kv_heads, d)``, already written
    to the caches at ``plan.slots``; a chunk starting at position 0 uses them directly
    instead of reading them back.
    """
    out = torch.empty_like(q)
    prefill_attention_(out, q, k, v, k_cache, v_cache, plan, scale)
    decode_attention_(out, q, k_cache, v_cache, plan, scale)
    return out


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: Sequence[int],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    scale: float,
) -> torch.Tensor:
    """The definition, one token at a time: ``q (T, H, d)`` → ``(T, H, d)`` (fp32 math).

    Token ``i`` of chunk ``c`` sits at position ``p = start_positions[c] + i`` and attends
    to the keys at positions ``0 .. p`` of its sequence, key ``j`` being read from block
    ``block_tables[c][j // block_size]``, offset ``j % block_size``. The caches must
    already hold every key up to ``p``.
    """
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    heads = q.shape[1]
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    row = 0
    for n, start, table in zip(query_lens, start_positions, block_tables, strict=True):
        for i in range(n):
            p = start + i
            keys = torch.arange(p + 1)
            blocks = torch.tensor([table[j // block_size] for j in keys.tolist()])
            k_j = k_cache[blocks, keys % block_size].float()  # (p + 1, kv_heads, d)
            v_j = v_cache[blocks, keys % block_size].float()
            for h in range(heads):
                kv = h // group  # query head h reads KV head h // group
                scores = (k_j[:, kv] @ q[row, h].float()) * scale  # (p + 1,)
                out[row, h] = torch.softmax(scores, dim=0) @ v_j[:, kv]
            row += 1
    return out.to(q.dtype)
