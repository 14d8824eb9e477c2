"""Parameter offload (``offload_param``, ZeRO stage 3): where parameter shards wait between uses.

- ``device = "cpu"``: each shard lives in (pinned) host memory; the all-gather input is
  copied to the model's device when the module is fetched.
- ``device = "nvme"``: each shard lives in this rank's swap file under ``nvme_path`` (one
  file, one aligned slot per parameter). A fetch reads the shard into a transient aligned
  buffer; stage 3's recorded module order is replayed to start reading the next modules'
  shards before they are fetched, holding at most ``buffer_count * buffer_size`` elements
  in flight. Updated shards are written back when the optimizer publishes them. Only the
  parameters below ``stage3_param_persistence_threshold`` (which stay gathered) remain
  in memory.
"""

from __future__ import annotations

import torch
from torch import nn

from zcore.config import ZConfig
from zcore.zero.stage3 import ShardedParam, ShardStore, Stage3Params
from zoffload.aio import AioConfig, AioHandle, new_aligned_tensor
from zoffload.swap import SwapIO, SwapSpace

_ALIGN_BYTES = 4096


class HostShards(ShardStore):
    """Shards in host memory (pinned when a GPU is present and ``pin_memory`` is set)."""

    def __init__(self, config: ZConfig, stage3: Stage3Params) -> None:
        off = config.zero_optimization.offload_param
        self.pin = bool(off and off.pin_memory) and torch.cuda.is_available()
        for p, sp in stage3.params.items():
            self.adopt(p, sp)

    def adopt(self, p: nn.Parameter, sp: ShardedParam) -> None:
        if not sp.persistent:
            sp.shard = sp.shard.to("cpu")
            if self.pin:
                sp.shard = sp.shard.pin_memory()


class NvmeShards(ShardStore):
    """Shards in a swap file; see the module docstring."""

    FILE = "params"

    def __init__(self, config: ZConfig, stage3: Stage3Params) -> None:
        off = config.zero_optimization.offload_param
        assert off is not None and off.nvme_path
        self.stage3 = stage3
        aio = AioHandle(config.aio or AioConfig())
        self.swap = SwapSpace.create(off.nvme_path, stage3.comm.rank, aio)
        self.budget = int(off.buffer_count) * int(off.buffer_size)
        self.offsets: dict[nn.Parameter, int] = {}
        self.dtypes: dict[nn.Parameter, torch.dtype] = {}  # as in the file
        self._pending: dict[nn.Parameter, tuple[torch.Tensor, SwapIO]] = {}
        self._pending_elems = 0
        self.buffer_size = int(off.buffer_size)
        self._end = 0  # next free element of the swap file
        for p, sp in stage3.params.items():
            self.adopt(p, sp)

    def adopt(self, p: nn.Parameter, sp: ShardedParam) -> None:
        if sp.persistent or p in self.offsets:
            return
        if sp.shard_size > self.buffer_size:
            raise ValueError(
                f"zero_optimization.offload_param.buffer_size = {self.buffer_size} elements is "
                f"smaller than the shard of {sp.name} ({sp.shard_size} elements); raise "
                f"buffer_size to at least {sp.shard_size}"
            )
        align = _ALIGN_BYTES // sp.shard.element_size()
        self.offsets[p] = self._end
        self._end += -(-sp.shard_size // align) * align
        self.dtypes[p] = sp.shard.dtype
        self._write(p, sp, sp.shard)
        sp.shard = torch.empty(0, dtype=sp.shard.dtype, device=sp.shard.device)

    # -- the store ------------------------------------------------------------------------
    def read(self, p: nn.Parameter, sp: ShardedParam) -> torch.Tensor:
        if p not in self.offsets:
            return sp.shard
        pending = self._take_pending(p)
        if pending is not None:
            buf, io = pending
            io.wait()
        else:
            buf = new_aligned_tensor(sp.shard_size, self.dtypes[p])
            self.swap.read(self.FILE, buf, self.offsets[p]).wait()
        return buf.to(p.dtype)  # the engine may have cast the model since the file was made

    def write(self, p: nn.Parameter, sp: ShardedParam, values: torch.Tensor, start: int) -> None:
        if p not in self.offsets:
            super().write(p, sp, values, start)
            return
        self._forget(p)  # a read started before this update would be stale
        if start == 0 and values.numel() == sp.shard_size:
            full = values
        else:  # part of the shard: read, modify, write the whole (one checksum per shard)
            full = self.read(p, sp)
            full[start : start + values.numel()].copy_(values)
        self._write(p, sp, full)

    def prefetch(self, params: list[nn.Parameter]) -> None:
        for p in params:
            if p not in self.offsets or p in self._pending:
                continue
            sp = self.stage3.params[p]
            if self._pending_elems + sp.shard_size > self.budget:
                break
            buf = new_aligned_tensor(sp.shard_size, self.dtypes[p])
            self._pending[p] = (buf, self.swap.read(self.FILE, buf, self.offsets[p]))
            self._pending_elems += sp.shard_size

    def close(self) -> None:
        for p in list(self._pending):
            self._forget(p)
        self.swap.close()

    # -- helpers --------------------------------------------------------------------------
    def _write(self, p: nn.Parameter, sp: ShardedParam, values: torch.Tensor) -> None:
        buf = new_aligned_tensor(sp.shard_size, self.dtypes[p])
        buf.copy_(values)
        self.swap.write(self.FILE, buf, self.offsets[p]).wait()

    def _take_pending(self, p: nn.Parameter) -> tuple[torch.Tensor, SwapIO] | None:
        """The read-ahead of ``p`` (no longer counted against the budget), if one was issued."""
        pending = self._pending.pop(p, None)
        if pending is not None:
            self._pending_elems -= pending[0].numel()
        return pending

    def _forget(self, p: nn.Parameter) -> None:
        pending = self._take_pending(p)
        if pending is not None:
            _, io = pending
            try:
                io.wait()
            except OSError:
                pass  # the value is being replaced; a failed read of the old one is moot

    def nvme_bytes(self) -> int:
        return self.swap.bytes_on_disk()


def host_params(config: ZConfig, stage3: Stage3Params) -> ShardStore:
    """The :mod:`zcore.zero.backends` factory for ``offload_param.device = "cpu"``."""
    return HostShards(config, stage3)


def nvme_params(config: ZConfig, stage3: Stage3Params) -> ShardStore:
    """The :mod:`zcore.zero.backends` factory for ``offload_param.device = "nvme"``."""
    return NvmeShards(config, stage3)


__all__ = ["HostShards", "NvmeShards", "host_params", "nvme_params"]
