"""ZeRO-Infinity optimizer offload (``offload_optimizer.device = "nvme"``).

Each rank's fp32 master partition, optimizer state (Adam's two moments, Adagrad's sum,
Lion's momentum) and fp32 gradient partition live in swap files under ``nvme_path``; host
memory holds the published weights at stages 1-2 (the parameters' dtype; at stage 3 the
parameter shards, themselves offloadable with ``offload_param``) and two sets of tile
buffers. Each reduced gradient slot is written out as its bucket completes (read, added
and rewritten when micro-steps accumulate), with its squared norm and finiteness noted,
so the global norm needs no pass over the file, and with its CRC-32, which the step
checks when it reads the slot back as part of its tiles. The master is built and written a tile at
a time at start, so the whole partition is never in memory. The step walks every partition in tiles
of ``sub_group_size`` elements: while tile *i* is updated by zcore's native CPU kernel, tile
*i+1* is being read and tile *i-1* written (``pipeline_read`` / ``pipeline_write``, on
by default; off, each read or write is waited on at once). An IO failure on any rank stops the step on
every rank before the weights are published, with the file and the fix in the message. A failed
gradient write is agreed on before any rank steps, so it changes nothing; a failure part-way
through the step (a read, a write, a corrupt gradient slot) leaves the swapped master and state a
mix of two steps, so further steps and checkpoint saves are refused until a checkpoint is loaded.

Only zcore's element-wise CPU optimizers (Adam, AdamW, Adagrad, Lion) can be stepped a tile
at a time; another optimizer is rejected at start.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from zcore.config import ZConfig
from zcore.optim import NativeOptimizer
from zcore.zero.layout import ParamShard
from zcore.zero.partition import Partition
from zcore.zero.store import OptimizerFactory, OptimizerStore, sq_norm
from zoffload.aio import AioConfig, AioHandle, new_aligned_tensor
from zoffload.swap import SwapError, SwapIO, SwapSpace, crc32, wait_all

_ALIGN = 1024  # elements per 4 KiB of fp32: tiles start on O_DIRECT boundaries


class _Tile:
    """One set of tile buffers: the master values, each state tensor, a gradient copy."""

    def __init__(self, numel: int, keys: tuple[str, ...]) -> None:
        self.master = new_aligned_tensor(numel, torch.float32)
        self.state = {k: new_aligned_tensor(numel, torch.float32) for k in keys}
        self.grad = new_aligned_tensor(numel, torch.float32)
        self.writes: list[SwapIO] = []

    def finish_writes(self) -> None:
        """Wait for every write of this set (all of them, even after one fails: the buffers
        are reused next), then raise the first failure."""
        writes, self.writes = self.writes, []
        failure = wait_all(writes)
        if failure is not None:
            raise failure


class NvmeStore(OptimizerStore):
    """An :class:`~zcore.zero.store.OptimizerStore` whose master weights, optimizer state
    and gradient partitions are on NVMe."""

    def __init__(self, config: ZConfig) -> None:
        self.config = config

    def attach(self, part: Partition, make_optimizer: OptimizerFactory, hyper: list[dict]) -> None:
        self.part = part
        config = self.config
        # the master lives on NVMe: the inner optimizer holds only the hyperparameters
        self.optimizer = make_optimizer([{**h, "params": [torch.empty(0)]} for h in hyper])
        offload = config.zero_optimization.offload_optimizer
        assert offload is not None and offload.nvme_path
        inner = self.optimizer
        if not isinstance(inner, NativeOptimizer):
            raise ValueError(
                'zero_optimization.offload_optimizer.device = "nvme" steps the optimizer a '
                f"tile at a time, which needs zcore's CPU optimizers (Adam, AdamW, Adagrad, "
                f"Lion); got {type(inner).__name__}: set optimizer.type to one of those"
            )
        if inner.state_dtype != torch.float32:
            raise ValueError(
                'zero_optimization.offload_optimizer.device = "nvme" keeps optimizer states in '
                f"float32 swap files; got state_dtype={inner.state_dtype}: construct the "
                "optimizer with state_dtype=torch.float32, or offload to the CPU "
                '(device = "cpu") to keep bfloat16 states'
            )
        self.keys = tuple(inner.state_keys)
        self.numels = [layout.numel for layout in part.layouts]
        self._starts = [[s.offset for s in layout.shards] for layout in part.layouts]
        largest = max(self.numels, default=0)
        size = min(int(config.zero_optimization.sub_group_size), max(largest, 1))
        self.tile = max(_ALIGN, -(-size // _ALIGN) * _ALIGN)
        aio = AioHandle(config.aio or AioConfig())
        self.swap = SwapSpace.create(offload.nvme_path, part.comm.rank, aio)
        self.pipeline_read = bool(offload.pipeline_read)
        self.pipeline_write = bool(offload.pipeline_write)
        self.steps = [0] * len(self.numels)
        # Read-ahead plus write-behind needs three tile sets: tile i computes while tile i+1
        # reads and tile i-1 writes. With two, reading i+1 into the set of i-1 first waits
        # for i-1's writes, which then never overlap any compute.
        sets = 3 if self.pipeline_read and self.pipeline_write else 2
        self._tiles = [_Tile(min(self.tile, max(largest, 1)), self.keys) for _ in range(sets)]
        # gradient slots written this cycle: their squared norm and the CRC-32 of the bytes
        self._written: dict[tuple[int, int], tuple[float, int]] = {}
        self._nonfinite = False
        self._grad_writes: list[SwapIO] = []
        # a gradient swap failure inside backward is raised at the step, on every rank at
        # once, rather than in one rank's hook (which would leave the others in a collective)
        self._grad_failure: SwapError | None = None
        self._grad_write_elems = 0
        # set when a step failed after some rank had stepped part of its partition: the
        # master and state on NVMe are then a mix of two steps, so stepping on or saving
        # them is refused until a checkpoint is loaded
        self._broken: str | None = None
        # the weights published after each step, in the parameters' dtype (stage 3: the shards)
        self.public: list[torch.Tensor | None] = [None] * len(self.numels)
        for g in range(len(self.numels)):
            if part.stage3 is None:
                dtype = part.params[g][0].dtype if part.params[g] else torch.float32
                self.public[g] = torch.zeros(self.numels[g], dtype=dtype)
            self._write_initial(g)

    def _write_initial(self, g: int) -> None:
        """Master (from the parameters), zero state and zero gradients, a tile at a time."""
        cached: tuple[torch.nn.Parameter | None, torch.Tensor] = (None, torch.empty(0))
        for i, (a, b) in enumerate(self._ranges(g)):
            t = self._tiles[i % len(self._tiles)]
            t.finish_writes()
            n = b - a
            t.master[:n].zero_()
            for p, shard, lo, hi in self._overlaps(g, a, b):
                if cached[0] is not p:  # a slot spanning tiles is fetched once (maybe from NVMe)
                    cached = (p, self.part.slot_of(p))
                t.master[lo - a : hi - a].copy_(cached[1][lo - shard.offset : hi - shard.offset])
            if self.public[g] is not None:
                self.public[g][a:b].copy_(t.master[:n])  # type: ignore[index]
            t.writes.append(self.swap.write(f"g{g}.master", t.master[:n], a))
            t.grad[:n].zero_()
            t.writes.append(self.swap.write(f"g{g}.grad", t.grad[:n], a, check=False))
            for k in self.keys:
                t.state[k][:n].fill_(self._initial_state(g, k))
                t.writes.append(self.swap.write(f"g{g}.{k}", t.state[k][:n], a))
        for t in self._tiles:
            t.finish_writes()

    def _initial_state(self, g: int, key: str) -> float:
        """What state ``key`` of group ``g`` starts at (Adagrad's initial accumulator)."""
        inner: NativeOptimizer = self.optimizer  # type: ignore[assignment]
        return inner.initial_state_value(key, inner.param_groups[g])

    # -- gradients on NVMe ------------------------------------------------------------------
    def accumulate(self, g: int, shard: ParamShard, values: torch.Tensor, alpha: float) -> None:
        if self._grad_failure is not None:
            return  # this step is lost already; it fails at update
        try:
            self._accumulate(g, shard, values, alpha)
        except SwapError as err:
            self._grad_failure = self._grad_failure or err

    def _accumulate(self, g: int, shard: ParamShard, values: torch.Tensor, alpha: float) -> None:
        key = (g, shard.offset)
        buf = new_aligned_tensor(shard.shard_size, torch.float32)
        torch.mul(values.to(buf.device), alpha, out=buf)
        if key in self._written:  # accumulating micro-steps: add what is on the file
            self._finish_grad_writes()
            if self._grad_failure is not None:
                return  # a write failed: what is on the file is not this slot's (reported first)
            old = torch.empty_like(buf)
            self.swap.read(f"g{g}.grad", old, shard.offset, check=False).wait()
            if crc32(old) != self._written[key][1]:
                raise self.swap.corrupt(f"g{g}.grad", shard.offset, buf.numel(), "a gradient slot")
            buf.add_(old)
        sq = sq_norm(buf)
        self._nonfinite |= not math.isfinite(sq)
        self._written[key] = (sq, crc32(buf))
        self._grad_writes.append(self.swap.write(f"g{g}.grad", buf, shard.offset, check=False))
        self._grad_write_elems += buf.numel()
        if self._grad_write_elems > 4 * self.tile:  # bound the copies held by writes in flight
            self._finish_grad_writes()

    def _finish_grad_writes(self) -> None:
        writes, self._grad_writes, self._grad_write_elems = self._grad_writes, [], 0
        self._grad_failure = self._grad_failure or wait_all(writes)

    def grad_sq_norm(self, groups: Sequence[int] | None = None) -> float:
        self._finish_grad_writes()
        if groups is None:
            return sum(sq for sq, _ in self._written.values())
        picked = set(groups)
        return sum(sq for (g, _), (sq, _) in self._written.items() if g in picked)

    def grads_nonfinite(self) -> bool:
        self._finish_grad_writes()
        return self._nonfinite

    def zero_grad(self) -> None:
        self._finish_grad_writes()
        self._written.clear()
        self._nonfinite = False

    def grad_bytes(self) -> int:
        return 0  # on NVMe

    def _prepare_grad_tile(
        self, g: int, a: int, b: int, grad: torch.Tensor, partial: dict[int, int]
    ) -> None:
        """Check the gradient slots met by tile ``[a, b)`` against the CRC-32 of what was
        written, and zero the parts of slots that got no gradient this cycle. A slot that
        runs on into the next tile leaves its CRC so far in ``partial`` and is checked when
        its last tile is read (tiles come in order)."""
        for _, shard, lo, hi in self._overlaps(g, a, b):
            written = self._written.get((g, shard.offset))
            if written is None:
                grad[lo - a : hi - a].zero_()
                continue
            crc = crc32(grad[lo - a : hi - a], partial.pop(shard.offset, 0))
            if hi < shard.offset + shard.shard_size:
                partial[shard.offset] = crc
            elif crc != written[1]:
                raise self.swap.corrupt(
                    f"g{g}.grad", shard.offset, shard.shard_size, "a gradient slot"
                )

    # -- swap files -------------------------------------------------------------------------
    def _overlaps(
        self, g: int, a: int, b: int
    ) -> Iterator[tuple[torch.nn.Parameter, ParamShard, int, int]]:
        """Parameters of group ``g`` whose slots meet elements ``[a, b)``, with the shared
        range ``[lo, hi)``; found by bisection (shards are in offset order)."""
        shards = self.part.layouts[g].shards
        i = max(bisect.bisect_right(self._starts[g], a) - 1, 0)
        while i < len(shards) and shards[i].offset < b:
            s = shards[i]
            lo, hi = max(a, s.offset), min(b, s.offset + s.shard_size)
            if lo < hi:
                yield self.part.params[g][i], s, lo, hi
            i += 1

    def _ranges(self, g: int) -> list[tuple[int, int]]:
        n = self.numels[g]
        return [(a, min(a + self.tile, n)) for a in range(0, n, self.tile)]

    def _write_group(
        self,
        g: int,
        master: torch.Tensor,
        zero_state: bool = False,
        state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Write a whole group's master (and state, or zeros) to its files, tile by tile."""
        for i, (a, b) in enumerate(self._ranges(g)):
            t = self._tiles[i % len(self._tiles)]
            t.finish_writes()
            n = b - a
            t.master[:n].copy_(master[a:b])
            t.writes.append(self.swap.write(f"g{g}.master", t.master[:n], a))
            for k in self.keys:
                if state is not None and k in state:
                    t.state[k][:n].copy_(state[k][a:b])
                elif zero_state or state is not None:
                    t.state[k][:n].fill_(self._initial_state(g, k))
                t.writes.append(self.swap.write(f"g{g}.{k}", t.state[k][:n], a))
        for t in self._tiles:
            t.finish_writes()

    def _read_group(self, g: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A whole group's master and state from its files (for checkpoints)."""
        master = torch.empty(self.numels[g], dtype=torch.float32)
        state = {k: torch.empty(self.numels[g], dtype=torch.float32) for k in self.keys}
        for a, b in self._ranges(g):
            ios = [self.swap.read(f"g{g}.master", master[a:b], a)]
            ios += [self.swap.read(f"g{g}.{k}", state[k][a:b], a) for k in self.keys]
            for io in ios:
                io.wait()
        return master, state

    def _read_tile(self, g: int, a: int, b: int, t: _Tile) -> list[SwapIO]:
        t.finish_writes()  # the buffers are about to be overwritten
        n = b - a
        ios = [self.swap.read(f"g{g}.master", t.master[:n], a)]
        ios += [self.swap.read(f"g{g}.{k}", t.state[k][:n], a) for k in self.keys]
        ios.append(self.swap.read(f"g{g}.grad", t.grad[:n], a, check=False))
        return ios

    # -- the step ---------------------------------------------------------------------------
    def update(self, coef: float) -> None:
        self._check_not_broken("step")
        # A gradient write that failed during backward was kept for here. Every rank learns
        # of it before any rank steps, so a lost gradient leaves every partition as it was.
        failure: BaseException | None = self._grad_failure
        self._grad_failure = None
        if self.part.comm.max_flag(failure is not None, "all_reduce(nvme gradients written)"):
            self.zero_grad()  # this step's gradients are lost; the next starts clean
            if failure is not None:
                raise failure
            raise SwapError(
                5,
                "another rank's NVMe gradient swap failed; see that rank's error (no "
                "weights or optimizer state changed)",
            )
        try:
            for g in range(len(self.numels)):
                self._update_group(g, coef)
        except SwapError as err:
            failure = err
        finally:
            failure = failure or self._drain_writes()
        # every rank learns of a failure before any publishes (no rank hangs in the gather)
        if self.part.comm.max_flag(failure is not None, "all_reduce(nvme step failed)"):
            # Some tiles of some partitions took this step and others did not.
            cause = str(failure) if failure is not None else "another rank's swap failed"
            self._broken = f"an earlier optimizer step failed part-way ({cause})"
            self.zero_grad()
            if failure is not None:
                raise failure
            raise SwapError(
                5, "another rank's NVMe swap failed during the step; see that rank's error"
            )

    def _drain_writes(self) -> SwapError | None:
        """Wait for every tile set's writes; the first failure, if any."""
        writes = [w for t in self._tiles for w in t.writes]
        for t in self._tiles:
            t.writes = []
        return wait_all(writes)

    def _check_not_broken(self, what: str) -> None:
        if self._broken is not None:
            raise SwapError(
                5,
                f"cannot {what}: {self._broken}, so the master weights and optimizer state "
                "on NVMe are a mix of two states; load the last checkpoint with "
                "engine.load_checkpoint(...) to continue",
            )

    def _update_group(self, g: int, coef: float) -> None:
        inner: NativeOptimizer = self.optimizer  # type: ignore[assignment]
        group = inner.param_groups[g]
        inner._check_group(group, f"param_groups[{g}]")
        self.steps[g] += 1
        self._finish_grad_writes()
        ranges = self._ranges(g)
        partial: dict[int, int] = {}  # CRCs of gradient slots read in part so far
        ahead = self.pipeline_read
        pending = self._read_tile(g, *ranges[0], self._tiles[0]) if ranges and ahead else []
        for i, (a, b) in enumerate(ranges):
            t, n = self._tiles[i % len(self._tiles)], b - a
            if not ahead:
                pending = self._read_tile(g, a, b, t)
            for io in pending:
                io.wait()
            if ahead and i + 1 < len(ranges):
                pending = self._read_tile(
                    g, *ranges[i + 1], self._tiles[(i + 1) % len(self._tiles)]
                )
            self._prepare_grad_tile(g, a, b, t.grad[:n], partial)
            if coef != 1.0:
                t.grad[:n].mul_(coef)
            state = {k: v[:n] for k, v in t.state.items()}
            inner._kernel(t.master[:n], t.grad[:n], state, group, self.steps[g])
            self._publish_tile(g, a, b, t.master[:n])
            t.writes.append(self.swap.write(f"g{g}.master", t.master[:n], a))
            t.writes += [self.swap.write(f"g{g}.{k}", state[k], a) for k in self.keys]
            if not self.pipeline_write:
                t.finish_writes()

    def _publish_tile(self, g: int, a: int, b: int, values: torch.Tensor) -> None:
        public = self.public[g]
        if public is not None:
            public[a:b].copy_(values)
            return
        stage3 = self.part.stage3
        assert stage3 is not None
        for p, shard, lo, hi in self._overlaps(g, a, b):
            stage3.write_shard(p, values[lo - a : hi - a], lo - shard.offset)

    # -- what the partition publishes from ------------------------------------------------
    def published(self, g: int) -> torch.Tensor | None:
        return self.public[g]  # None at stage 3: the step wrote the shards

    def refresh(self, p: torch.nn.Parameter) -> None:
        """A full value edited under GatheredParameters: rewrite the tiles it touches."""
        g, shard = self.part.where[p]
        slot = self.part.slot_of(p)
        lo, hi = shard.offset, shard.offset + shard.shard_size
        for a, b in self._ranges(g):
            if b <= lo or a >= hi:
                continue
            t = self._tiles[0]
            t.finish_writes()
            self.swap.read(f"g{g}.master", t.master[: b - a], a).wait()
            s, e = max(a, lo), min(b, hi)
            t.master[s - a : e - a].copy_(slot[s - lo : e - lo])
            t.writes.append(self.swap.write(f"g{g}.master", t.master[: b - a], a))
            t.finish_writes()
        if self.public[g] is not None:
            self.public[g][lo:hi].copy_(slot)  # type: ignore[index]

    # -- checkpoints ------------------------------------------------------------------------
    def master_for_save(self) -> list[torch.Tensor]:
        self._check_not_broken("save a checkpoint")
        return [self._read_group(g)[0] for g in range(len(self.numels))]

    def optimizer_state_for_save(self) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for g in range(len(self.numels)):
            if self.steps[g]:
                _, state = self._read_group(g)
                out[g] = {"step": torch.tensor(float(self.steps[g])), **state}
        return out

    def master_for_load(self) -> list[torch.Tensor]:
        return [torch.zeros(n, dtype=torch.float32) for n in self.numels]

    def finish_load(self, masters: list[torch.Tensor], state: dict[str, Any] | None) -> None:
        self._drain_writes()  # writes left by an earlier failure: all rewritten below
        # Until every group's master and state is rewritten, the files mix two states.
        self._broken = "a checkpoint load failed part-way while writing the swap files"
        try:
            self._finish_load(masters, state)
        finally:
            failure = self._drain_writes()
        if failure is not None:
            raise failure
        self._broken = None

    def _finish_load(self, masters: list[torch.Tensor], state: dict[str, Any] | None) -> None:
        for g, m in enumerate(masters):
            saved = (state or {}).get("state", {}).get(g, {})
            if state is not None:
                self.steps[g] = int(float(saved.get("step", 0)))
                group = state["param_groups"][g]
                self.optimizer.param_groups[g].update(
                    {k: v for k, v in group.items() if k != "params"}
                )
            tensors = {k: saved[k] for k in self.keys if k in saved}
            self._write_group(g, m, zero_state=state is not None, state=tensors)
            public = self.public[g]
            if public is not None:
                public.copy_(m)
            else:
                self._publish_tile(g, 0, self.numels[g], m)

    # -- accounting -------------------------------------------------------------------------
    def optimizer_bytes(self) -> int:
        """Host bytes of the optimizer side: tile buffers (the master and state are on NVMe)."""
        t = self._tiles[0]
        per_set = (t.master.numel() + t.grad.numel()) * 4 + sum(
            v.numel() * 4 for v in t.state.values()
        )
        return len(self._tiles) * per_set

    def nvme_bytes(self) -> int:
        """Bytes of this rank's swap files."""
        return self.swap.bytes_on_disk()

    def close(self) -> None:
        self.swap.close()


def nvme_optimizer(config: ZConfig) -> OptimizerStore:
    """The :mod:`zcore.zero.backends` store for ``device = "nvme"``."""
    return NvmeStore(config)
