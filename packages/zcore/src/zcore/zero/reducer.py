"""Gradient reduction into each rank's flat partition, in buckets, during backward.

Every parameter's gradient is cut into ``world`` slots (see :mod:`zcore.zero.layout`).
When a gradient is ready (a post-accumulate-grad hook) it is divided by the data-parallel
size and copied straight into the current bucket, so the caller can drop the model-sized
gradient at once. A full bucket's collective is issued asynchronously (``overlap_comm``)
and runs while backward goes on; when it completes, each rank adds its own slots into its
gradient partition. Bucket buffers are reused: at most two exist (one filling, one in
flight), each of ``min(reduce_bucket_size, model size)`` elements, and a parameter bigger
than a bucket gets a buffer of its own.

Two bucket layouts, one per collective:

* ``reduce_scatter`` — a ``(world, cols)`` buffer whose row ``r`` holds rank ``r``'s slots
  of every member; rank ``r`` receives row ``r`` summed over ranks.
* ``all_reduce`` (stage 0, ``reduce_scatter: false`` and gloo, where it is ~2x faster) —
  members one after another, each as its ``(world, shard_size)`` slot grid; the whole
  used prefix is summed and each rank reads its own slot of every member.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zcore.comm import Comm, Handle
from zcore.zero.collectives import Collectives
from zcore.zero.layout import ParamShard, slot_view


@dataclass
class _Bucket:
    buf: torch.Tensor  # flat, `capacity` elements (or one oversized member's)
    pooled: bool
    members: list[tuple[int, ParamShard, int]] = field(default_factory=list)
    used: int = 0  # elements (all-reduce layout) or columns (reduce-scatter layout)


@dataclass
class _Pending:
    handle: Handle
    bucket: _Bucket
    out: torch.Tensor | None  # reduce-scatter output (this rank's row)


class GradReducer:
    """Reduce gradients into each rank's gradient partitions (one per parameter group).

    Args:
        accumulate: ``accumulate(group, shard, values, alpha)`` adds ``alpha * values``
            (this rank's reduced slot of one parameter) into its gradient partition.
        shard_world: ranks the layout is cut for (1 at stage 0, where grads are all-reduced).
        bucket_elems: ``reduce_bucket_size``: elements per bucket, padding included.
        total_elems: elements of every reduced gradient, padding included; bounds the
            bucket buffers for models smaller than a bucket.
        comm_dtype: dtype on the wire; ``None`` keeps the gradient's dtype.
        predivide: every gradient is divided by this before it is summed across ranks.
        postscale: the sums are multiplied by this as they are added to the partitions.
        reduce_scatter: ``False`` all-reduces the buckets (each rank keeps its slots).
        replicas: collectives across replicas of the partition (MiCS): what this rank
            received is summed across them too before it is accumulated.
        collectives: how the buckets travel (:mod:`zcore.zero.collectives`; full precision).
    """

    def __init__(
        self,
        comm: Comm,
        accumulate: Callable[[int, ParamShard, torch.Tensor, float], None],
        shard_world: int,
        bucket_elems: int,
        overlap: bool,
        comm_dtype: torch.dtype | None,
        predivide: float,
        reduce_scatter: bool = True,
        total_elems: int | None = None,
        postscale: float = 1.0,
        replicas: Comm | None = None,
        collectives: Collectives | None = None,
    ) -> None:
        self.comm = comm
        self.collectives = collectives or Collectives()
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        self.accumulate = accumulate
        self.shard_world = shard_world
        w = shard_world
        capacity = max(1, bucket_elems)
        if total_elems is not None:
            capacity = max(1, min(capacity, total_elems))
        self.cols = -(-capacity // w)  # columns of a reduce-scatter bucket
        self.capacity = self.cols * w
        self.overlap = overlap
        self.comm_dtype = comm_dtype
        self.predivide = predivide
        self.postscale = postscale
        self.scatter = reduce_scatter and w > 1
        self.direct = (
            w == 1
            and comm.size == 1
            and self.replicas is None
            and predivide == 1.0
            and type(self.collectives) is Collectives
        )
        """One rank holds the whole partition and the sum over one rank is the gradient
        itself: :meth:`add` accumulates it straight from the gradient, with no bucket (the
        same values the bucket would hand on, as long as ``comm_dtype`` is the gradient's)."""
        self._bucket: _Bucket | None = None
        self._pending: list[_Pending] = []
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}
        self._pooled: dict[torch.dtype, int] = {}

    # -- buffers --------------------------------------------------------------------------
    def _take(self, dtype: torch.dtype, device: torch.device, elems: int) -> _Bucket:
        if elems > self.capacity:  # an oversized parameter: a buffer of its own
            return _Bucket(torch.empty(elems, dtype=dtype, device=device), pooled=False)
        free = self._free.setdefault(dtype, [])
        while not free and self._pooled.get(dtype, 0) >= 2 and self._pending:
            self._drain_one()  # both buffers busy: finish the oldest collective
        if free:
            return _Bucket(free.pop(), pooled=True)
        self._pooled[dtype] = self._pooled.get(dtype, 0) + 1
        return _Bucket(torch.empty(self.capacity, dtype=dtype, device=device), pooled=True)

    def spare(self, dtype: torch.dtype, elems: int) -> torch.Tensor | None:
        """An idle pooled bucket buffer of ``dtype`` with at least ``elems`` elements, lent to
        the caller until this reducer's next ``add`` (between ``finish`` and the next
        backward every pooled buffer is idle: the optimizer step gathers into one)."""
        if self._pending or self._bucket is not None:
            return None
        fits = [b for b in self._free.get(dtype, []) if b.numel() >= elems]
        return min(fits, key=torch.Tensor.numel) if fits else None

    def _give_back(self, bucket: _Bucket) -> None:
        if bucket.pooled:  # an oversized bucket's buffer is simply dropped
            self._free.setdefault(bucket.buf.dtype, []).append(bucket.buf)

    # -- filling --------------------------------------------------------------------------
    def add(self, group: int, shard: ParamShard, grad: torch.Tensor) -> None:
        """Copy one parameter's full gradient into a bucket; the caller may drop it then."""
        w = self.shard_world
        size = shard.shard_size
        dtype = self.comm_dtype or grad.dtype
        if self.direct and dtype == grad.dtype:
            self.accumulate(group, shard, grad.reshape(-1), self.postscale)
            return
        b = self._bucket
        # A reduce-scatter bucket is a (w, cols) grid; an oversized one is sized to its
        # single parameter (cols = its shard size), so nothing joins it.
        fits = (
            b is not None
            and b.buf.dtype == dtype
            and (
                b.pooled and b.used + size <= self.cols
                if self.scatter
                else b.used + size * w <= b.buf.numel()
            )
        )
        if b is not None and not fits:
            self.flush()
            b = None
        if b is None:
            b = self._bucket = self._take(dtype, grad.device, size * w)
        flat = grad.reshape(-1)
        if self.scatter:
            cols = self.cols if b.pooled else size
            dst = b.buf[: w * cols].view(w, cols)[:, b.used : b.used + size]
            src = slot_view(flat, shard, w)
            b.members.append((group, shard, b.used))
            b.used += size
        else:
            block = b.buf[b.used : b.used + w * size]
            block[shard.numel :].zero_()
            dst, src = block[: shard.numel], flat
            b.members.append((group, shard, b.used))
            b.used += w * size
        if self.predivide != 1.0:
            torch.div(src, self.predivide, out=dst)
        else:
            dst.copy_(src)

    def flush(self) -> None:
        """Issue the current bucket's collective."""
        b, self._bucket = self._bucket, None
        if b is None or not b.members:
            return
        w = self.shard_world
        if self.scatter:
            cols = self.cols if b.pooled else b.used
            grid = b.buf[: w * cols].view(w, cols)[:, : b.used]
            inp = grid if grid.is_contiguous() else grid.contiguous()
            out = torch.empty(b.used, dtype=inp.dtype, device=inp.device)
            what = f"reduce_scatter(gradient bucket, {inp.numel()} elems)"
            handle = self.collectives.reduce_scatter(self.comm, out, inp.view(-1), what)
            self._pending.append(_Pending(handle, b, out))
        else:
            what = f"all_reduce(gradient bucket, {b.used} elems)"
            handle = self.collectives.all_reduce(self.comm, b.buf[: b.used], what)
            self._pending.append(_Pending(handle, b, None))
        if not self.overlap:
            self._drain()

    # -- completion -----------------------------------------------------------------------
    def _drain_one(self) -> None:
        p = self._pending.pop(0)
        p.handle.wait()
        b = p.bucket
        if self.replicas is not None:  # the same partition on every replica: sum them
            summed = p.out if p.out is not None else b.buf[: b.used]
            what = f"all_reduce(gradient bucket across replicas, {summed.numel()} elems)"
            self.collectives.all_reduce(self.replicas, summed, what).wait()
        rank = self.comm.rank if self.shard_world > 1 else 0
        for group, shard, at in b.members:
            size = shard.shard_size
            if p.out is not None:
                src = p.out[at : at + size]
            else:
                src = b.buf[at + rank * size : at + (rank + 1) * size]
            self.accumulate(group, shard, src, self.postscale)
        self._give_back(b)

    def _drain(self) -> None:
        while self._pending:
            self._drain_one()

    def finish(self) -> None:
        """Flush the last bucket and wait for every collective; partitions are then complete."""
        self.flush()
        self._drain()
