"""Merging small JSON dicts across the ranks of one axis (what each pipeline stage knows
of its own layers, e.g. their tensor-parallel cuts, for a manifest rank 0 writes)."""

from __future__ import annotations

import json
from typing import Any

import torch

from zcore.comm import Comm


def gather_json(
    comm: Comm, mine: dict[str, Any], device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """Every rank's ``mine`` merged (keys of later ranks win), on every rank of ``comm``
    (tensors on ``device``: the backend's).

    Collective: two all-gathers (the lengths, then the padded UTF-8 bytes)."""
    if comm.size == 1:
        return dict(mine)
    raw = list(json.dumps(mine, sort_keys=True).encode())
    data = torch.tensor(raw, dtype=torch.uint8, device=device)
    lengths = torch.zeros(comm.size, dtype=torch.int64, device=device)
    one = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    comm.all_gather(lengths, one, "all_gather(json lengths)").wait()
    width = int(lengths.max())
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = torch.zeros(comm.size * width, dtype=torch.uint8, device=device)
    comm.all_gather(out, padded, "all_gather(json)").wait()
    out, lengths = out.cpu(), lengths.cpu()
    merged: dict[str, Any] = {}
    for r in range(comm.size):
        row = out[r * width : r * width + int(lengths[r])]
        merged.update(json.loads(bytes(row.tolist()).decode()))
    return merged
