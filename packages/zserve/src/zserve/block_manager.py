"""The KV-cache block allocator and prefix cache.

The model runner's KV cache is `num_blocks` blocks of `block_size` token slots; a
sequence's keys/values live in the blocks of its block table, in order. This module
decides which blocks a sequence gets; it never touches the tensors.

Blocks are reference-counted: a full block whose tokens another sequence already
computed is shared instead of recomputed (prefix caching). The runner only writes
positions `[start_pos, start_pos + len)` of a sequence, and a shared block is always
full and wholly before the first position a sequence computes, so sharing is safe.

Prefix cache: a full block is keyed by a hash chained over the token prefix,
`h_i = blake2b(h_{i-1} || tokens of block i)`, so a key names the whole prefix up
to the end of that block, not just the block's own tokens. Freed blocks keep
their key and stay findable until the allocator needs the slot: the free queue is
in LRU order (plain free blocks first, then cached ones, least recently freed
first), and taking a cached block from it evicts its key.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

_ROOT_HASH = b"zserve-prefix-v1"


def _block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a full block: its parent's key chained with its own token ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


@dataclass(frozen=True)
class KVCacheBlocks:
    """The hand-off between the scheduler and the block manager: block ids, in order."""

    block_ids: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.block_ids)


NO_BLOCKS = KVCacheBlocks()


@dataclass
class _SeqBlocks:
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # keys of blocks[: len(hashes)]


class BlockManager:
    """Allocates, shares and frees KV blocks for sequences identified by an int id."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        # Blocks with ref 0, head = next to hand out. Values unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._seqs: dict[int, _SeqBlocks] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached-but-unreferenced ones included: evictable)."""
        return len(self._free)

    def num_cached_blocks(self) -> int:
        """Blocks findable in the prefix cache (referenced or not)."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_table(self, seq_id: int) -> list[int]:
        """The blocks of `seq_id`, in position order (empty if it holds none)."""
        s = self._seqs.get(seq_id)
        return list(s.blocks) if s else []

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------------
    def get_computed_blocks(self, token_ids: Sequence[int]) -> tuple[KVCacheBlocks, int]:
        """The longest cached run of full blocks that prefixes `token_ids`, and its
        length in tokens. At least one token is always left to compute (the forward
        that produces the next token's logits needs one). Counts nothing: the caller
        reports the lookups it acts on with `record_prefix_lookup`."""
        if not self.enable_prefix_caching:
            return KVCacheBlocks(), 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        found: list[int] = []
        parent = _ROOT_HASH
        bs = self.block_size
        for i in range(max_blocks):
            key = _block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(key)
            if block is None:
                break
            found.append(block)
            parent = key
        return KVCacheBlocks(tuple(found)), len(found) * bs

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted sequence's lookup: `num_hit_tokens` of `num_tokens` reused."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the blocks of `seq_id` that `num_computed` tokens filled since the
        last call; `token_ids` are the sequence's tokens (at least `num_computed`)."""
        if not self.enable_prefix_caching:
            return
        s = self._seqs[seq_id]
        bs = self.block_size
        for i in range(len(s.hashes), min(num_computed // bs, len(s.blocks))):
            parent = s.hashes[-1] if s.hashes else _ROOT_HASH
            key = _block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            s.hashes.append(key)
            block = s.blocks[i]
            # Another sequence may have computed the same block at the same time: the first
            # one stays the cached copy, this one is a private duplicate.
            if key not in self._cached and self._key[block] is None:
                self._cached[key] = block
                self._key[block] = key

    # -- allocation ------------------------------------------------------------------------
    def can_allocate(
        self, seq_id: int, num_tokens: int, computed: KVCacheBlocks = NO_BLOCKS
    ) -> bool:
        """Whether `allocate(seq_id, num_tokens, computed)` would succeed."""
        return self._new_blocks_needed(seq_id, num_tokens, computed) >= 0

    def _new_blocks_needed(self, seq_id: int, num_tokens: int, computed: KVCacheBlocks) -> int:
        """Blocks to take from the free queue, or -1 if there are not enough."""
        held = len(self._seqs[seq_id].blocks) if seq_id in self._seqs else 0
        if held and len(computed):
            raise ValueError(
                f"seq {seq_id} already holds {held} blocks; computed blocks are "
                "only for a sequence's first allocation"
            )
        need = max(0, self.blocks_needed(num_tokens) - held - len(computed))
        # Computed blocks with ref 0 sit in the free queue: touching them takes them out.
        reclaimed = sum(1 for b in computed.block_ids if self._ref[b] == 0)
        return need if need <= len(self._free) - reclaimed else -1

    def allocate(
        self, seq_id: int, num_tokens: int, computed: KVCacheBlocks = NO_BLOCKS
    ) -> KVCacheBlocks | None:
        """Grow `seq_id`'s table to hold `num_tokens` tokens, first adopting the
        prefix-cache blocks `computed` (only on a sequence's first allocation).
        Returns the new table, or None (and changes nothing) if blocks ran out."""
        need = self._new_blocks_needed(seq_id, num_tokens, computed)
        if need < 0:
            return None
        s = self._seqs.setdefault(seq_id, _SeqBlocks())
        for b in computed.block_ids:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
            s.blocks.append(b)
            s.hashes.append(self._key[b])  # type: ignore[arg-type]  # cached => keyed
        for _ in range(need):
            b, _ = self._free.popitem(last=False)
            key = self._key[b]
            if key is not None:  # evict: the slot is about to be overwritten
                del self._cached[key]
                self._key[b] = None
            self._ref[b] = 1
            s.blocks.append(b)
        return KVCacheBlocks(tuple(s.blocks))

    def free(self, seq_id: int) -> None:
        """Drop `seq_id`'s references; unknown ids are a no-op."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            return
        # Tail blocks first: a sequence's last blocks are the least likely to be shared,
        # so they are evicted before its (more shareable) first blocks.
        for b in reversed(s.blocks):
            self._release(b, seq_id)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Shrink `seq_id`'s table to the blocks `num_tokens` tokens need, releasing the
        tail (the slots of speculative tokens the target rejected). Unknown ids are a
        no-op; dropping a block already published to the prefix cache is a ValueError."""
        s = self._seqs.get(seq_id)
        if s is None:
            return
        keep = self.blocks_needed(num_tokens)
        if keep < len(s.hashes):
            raise ValueError(
                f"seq {seq_id}: truncating to {num_tokens} tokens ({keep} blocks) would drop "
                f"{len(s.hashes) - keep} block(s) already in the prefix cache"
            )
        for b in reversed(s.blocks[keep:]):
            self._release(b, seq_id)
        del s.blocks[keep:]

    def _release(self, b: int, seq_id: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] < 0:
            raise RuntimeError(f"block {b} freed more often than allocated (seq {seq_id})")
        if self._ref[b] == 0:
            self._free[b] = None
            if self._key[b] is None:
                self._free.move_to_end(b, last=False)  # uncached: hand out first

    def reset_prefix_cache(self) -> None:
        """Forget every cached key (blocks in use stay allocated)."""
        for b in self._cached.values():
            self._key[b] = None
        self._cached.clear()
        for s in self._seqs.values():
            s.hashes.clear()
