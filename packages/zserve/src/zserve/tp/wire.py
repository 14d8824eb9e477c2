"""A step's batch as one int64 tensor, for rank 0's command to the tensor-parallel workers.

Layout: ``[n, (seq_id, start_pos, tokens, blocks, want_logits, all_logits) * n, token ids...,
block ids...]``, chunk by chunk. The workers rebuild the same :class:`~zserve.runner.SeqChunk`
list, so every rank runs the same ragged forward over the same block tables.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zserve.runner import SeqChunk

HEAD = 6
"""Integers per chunk before the token and block ids."""


def encode(chunks: Sequence[SeqChunk]) -> torch.Tensor:
    """The batch ``chunks`` as one int64 tensor."""
    head: list[int] = [len(chunks)]
    body: list[int] = []
    for c in chunks:
        head += [
            c.seq_id,
            c.start_pos,
            len(c.token_ids),
            len(c.block_table),
            int(c.want_logits),
            int(c.all_logits),
        ]
        body += c.token_ids
        body += c.block_table
    return torch.tensor(head + body, dtype=torch.int64)


def decode(payload: torch.Tensor) -> list[SeqChunk]:
    """The chunks :func:`encode` packed."""
    flat = payload.tolist()
    n = flat[0]
    at = 1 + HEAD * n
    chunks = []
    for i in range(n):
        seq_id, start, tokens, blocks, want, all_logits = flat[1 + HEAD * i : 1 + HEAD * (i + 1)]
        ids = flat[at : at + tokens]
        at += tokens
        table = flat[at : at + blocks]
        at += blocks
        chunks.append(SeqChunk(seq_id, ids, start, table, bool(want), bool(all_logits)))
    return chunks


def logit_rows(chunks: Sequence[SeqChunk]) -> int:
    """Rows of logits a forward of ``chunks`` returns (:meth:`ModelRunner.forward`'s rule)."""
    return sum(len(c.token_ids) if c.all_logits else int(c.want_logits) for c in chunks)
