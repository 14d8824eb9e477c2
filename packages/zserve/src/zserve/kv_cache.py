"""The blocked (paged) KV cache: the tensors only.

Which sequence owns which block is the block manager's business; this module holds
the memory. Every layer has one key and one value tensor of shape
``(num_blocks, block_size, num_kv_heads, head_dim)``: position ``p`` of a sequence
whose block table is ``bt`` lives at ``[bt[p // block_size], p % block_size]``, i.e.
at flat *slot* ``bt[p // block_size] * block_size + p % block_size`` of the
``(num_blocks * block_size, num_kv_heads, head_dim)`` view.

The tensors start zeroed, so a padded read of a never-written block is finite (a masked
score times a NaN value would still be NaN).
"""

from __future__ import annotations

import torch

#: KV memory used when neither ``num_blocks`` nor ``kv_cache_bytes`` is given.
DEFAULT_KV_CACHE_BYTES = 1 << 30


class KVCache:
    """Per-layer key/value block tensors ``(num_blocks, block_size, num_kv_heads, head_dim)``."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # One allocation for all layers: (layers, 2, blocks, block_size, kv_heads, head_dim).
        self._storage = torch.zeros((num_layers, 2, *shape), dtype=dtype, device=device)
        self.keys: list[torch.Tensor] = [self._storage[i, 0] for i in range(num_layers)]
        self.values: list[torch.Tensor] = [self._storage[i, 1] for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes over all layers, keys and values."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def kv_bytes_per_block(self) -> int:
        """Bytes one block of this cache takes over all layers, keys and values."""
        return self.bytes_per_block(
            num_layers=self.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
        )

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``(T, num_kv_heads, head_dim)`` at flat ``slots`` ``(T,)`` of ``layer``."""
        flat = (-1, self.num_kv_heads, self.head_dim)
        self.keys[layer].view(flat).index_copy_(0, slots, k.to(self.dtype))
        self.values[layer].view(flat).index_copy_(0, slots, v.to(self.dtype))
