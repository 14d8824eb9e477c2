"""Gradient reduction into each rank's flat partition, in buckets, during backward.

Every parameter's gradient is cut into ``world`` slots (see :mod:`zcore.zero.layout`).
When a gradient is ready (a post-accumulate-grad hook) it is copied into the current
bucket, a ``(world, S)`` buffer whose row ``r`` holds rank ``r``'s slots of every bucket
member; the model-sized gradient is dropped at once. A full bucket is reduce-scattered
asynchronously (``overlap_comm``) so communication runs while backward goes on, and each
rank receives only its own row: the averaged gradient of its partition. Stage 0 uses the
same path with ``world = 1`` and an all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zcore.comm import Comm, Handle
from zcore.zero.layout import ParamShard, slot_view


@dataclass
class _Pending:
    handle: Handle
    out: torch.Tensor
    members: list[tuple[int, ParamShard, int]]  # (group, shard, column in bucket)


@dataclass
class _Bucket:
    grads: list[tuple[int, ParamShard, torch.Tensor]] = field(default_factory=list)
    elems: int = 0


class GradReducer:
    """Reduce gradients into ``partitions`` (one flat buffer per parameter group).

    Args:
        partition: returns this rank's gradient partition of a group (allocating it on
            first use), accumulated into across micro-steps.
        shard_world: ranks the layout is cut for (1 at stage 0, where grads are all-reduced).
        comm_dtype: dtype on the wire; ``None`` keeps the gradient's dtype.
        predivide: every gradient is divided by this before it is summed across ranks.
    """

    def __init__(
        self,
        comm: Comm,
        partition: Callable[[int], torch.Tensor],
        shard_world: int,
        bucket_elems: int,
        overlap: bool,
        comm_dtype: torch.dtype | None,
        predivide: float,
        reduce_scatter: bool = True,
    ) -> None:
        self.comm = comm
        self.partition = partition
        self.shard_world = shard_world
        self.bucket_elems = max(1, bucket_elems)
        self.overlap = overlap
        self.comm_dtype = comm_dtype
        self.predivide = predivide
        self.reduce_scatter = reduce_scatter
        self._bucket = _Bucket()
        self._pending: list[_Pending] = []
        self.peak_bucket_bytes = 0

    def add(self, group: int, shard: ParamShard, grad: torch.Tensor) -> None:
        """Queue one parameter's full gradient; the caller may drop its reference afterwards."""
        self._bucket.grads.append((group, shard, grad))
        self._bucket.elems += shard.shard_size * self.shard_world
        if self._bucket.elems >= self.bucket_elems:
            self.flush()

    def flush(self) -> None:
        """Issue the current bucket's collective."""
        bucket, self._bucket = self._bucket, _Bucket()
        if not bucket.grads:
            return
        w = self.shard_world
        cols = sum(s.shard_size for _, s, _ in bucket.grads)
        dtype = self.comm_dtype or bucket.grads[0][2].dtype
        buf = torch.empty(w, cols, dtype=dtype, device=bucket.grads[0][2].device)
        members, col = [], 0
        for group, shard, grad in bucket.grads:
            buf[:, col : col + shard.shard_size].copy_(slot_view(grad.reshape(-1), shard, w))
            members.append((group, shard, col))
            col += shard.shard_size
        if self.predivide != 1.0:
            buf.div_(self.predivide)
        self.peak_bucket_bytes = max(self.peak_bucket_bytes, 2 * buf.numel() * buf.element_size())
        what = f"{'reduce_scatter' if w > 1 else 'all_reduce'}(gradient bucket, {cols * w} elems)"
        if w > 1 and self.reduce_scatter:
            out = torch.empty(cols, dtype=dtype, device=buf.device)
            handle = self.comm.reduce_scatter(out, buf.view(-1), what)
        elif w > 1:  # `reduce_scatter: false`: all-reduce the bucket, keep this rank's row
            handle = self.comm.all_reduce(buf, what.replace("reduce_scatter", "all_reduce"))
            out = buf[self.comm.rank]
        else:
            out = buf.view(-1)
            handle = self.comm.all_reduce(out, what)
        self._pending.append(_Pending(handle, out, members))
        if not self.overlap:
            self._drain()

    def _drain(self) -> None:
        for p in self._pending:
            p.handle.wait()
            for group, shard, col in p.members:
                dst = self.partition(group)[shard.offset : shard.offset + shard.shard_size]
                dst.add_(p.out[col : col + shard.shard_size])
        self._pending.clear()

    def finish(self) -> None:
        """Flush the last bucket and wait for every collective; partitions are then complete."""
        self.flush()
        self._drain()
