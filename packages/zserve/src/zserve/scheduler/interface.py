"""The seam between the engine, the scheduler and the KV-block manager.

The engine talks to a `Scheduler` (add / abort / schedule / update / finish) and gets
a `SchedulerOutput`: the chunks to run in one ragged forward. The scheduler talks to
the `BlockManager` only through block counts and `KVCacheBlocks`. A policy is a
subclass that implements `schedule()`; the bookkeeping shared by every policy
(queues, admission with prefix-cache lookup, preemption by recompute, the
never-fits check) lives in `BaseScheduler`.
"""

from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass, field

from zserve.block_manager import NO_BLOCKS, BlockManager, KVCacheBlocks
from zserve.scheduler.request import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens `[start, start + num_tokens)` of `seq` go into this forward."""

    seq: Sequence
    start: int
    num_tokens: int
    num_lookahead: int = 0
    """KV slots reserved past the chunk for draft tokens (speculative decoding of a
    decode chunk): the engine may verify up to this many drafts in the same forward."""

    @property
    def want_logits(self) -> bool:
        """The chunk reaches the sequence's end, so its last logits give the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_tokens]


@dataclass
class SchedulerOutput:
    """One step: the chunks of the forward, sequences preempted to make room, and
    sequences finished by the scheduler itself (requests that can never fit)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler(abc.ABC):
    """What the engine needs from a scheduling policy."""

    kv: BlockManager

    @abc.abstractmethod
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request and free its blocks now; None if unknown or already done."""

    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Choose the next forward's chunks, allocating (or preempting for) blocks."""

    @abc.abstractmethod
    def update(self, output: SchedulerOutput) -> None:
        """Record that `output`'s forward ran: advance progress, publish full blocks."""

    @abc.abstractmethod
    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (stop/length/...) and free its blocks."""

    @abc.abstractmethod
    def commit_lookahead(self, seq: Sequence, num_accepted: int) -> None:
        """After a decode chunk with `num_lookahead` slots ran: `num_accepted` draft
        tokens (now in `seq.output_token_ids`) have valid KV; release the rest."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool: ...

    @abc.abstractmethod
    def stats(self) -> dict[str, int]: ...


class BaseScheduler(Scheduler):
    """Queues and block bookkeeping shared by the policies."""

    def __init__(self, kv: BlockManager, max_num_seqs: int):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs is {max_num_seqs}; it must be >= 1")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._rejected: list[Sequence] = []
        self.num_preemptions = 0

    # -- requests ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request_id {seq.request_id!r} is already in the scheduler")
        need = self.kv.blocks_needed(seq.max_len)
        if need > self.kv.num_blocks:
            # Even alone it would run out of blocks: finish now instead of preempting forever.
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = "error"
            seq.error = (
                f"request needs {need} KV blocks ({len(seq.prompt_token_ids)} prompt + "
                f"{seq.params.max_tokens} max_tokens tokens, block_size {self.kv.block_size}) "
                f"but the cache has {self.kv.num_blocks}; lower max_tokens or give the "
                "engine more KV cache (num_blocks / kv_cache_bytes)"
            )
            self._rejected.append(seq)
            return
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq.seq_id)
        self._by_id.pop(seq.request_id, None)

    def update(self, output: SchedulerOutput) -> None:
        for c in output.chunks:
            seq = c.seq
            seq.num_computed_tokens = c.start + c.num_tokens
            self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    def commit_lookahead(self, seq: Sequence, num_accepted: int) -> None:
        seq.num_computed_tokens += num_accepted
        if seq.num_remaining != 1:
            raise RuntimeError(
                f"seq {seq.seq_id}: {seq.num_computed_tokens} computed of {seq.num_tokens} "
                f"tokens after accepting {num_accepted} drafts; expected exactly 1 pending"
            )
        self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        # Hold what plain decoding would hold now: the rejected drafts' slots go back.
        self.kv.truncate(seq.seq_id, seq.num_computed_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._rejected)

    def stats(self) -> dict[str, int]:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preempted": self.num_preemptions,
            "free_blocks": self.kv.num_free_blocks,
            "total_blocks": self.kv.num_blocks,
            "prefix_hits": self.kv.prefix_hits,
            "prefix_queries": self.kv.prefix_queries,
        }

    # -- helpers for policies -------------------------------------------------------------
    def _new_output(self) -> SchedulerOutput:
        out = SchedulerOutput(finished=self._rejected)
        self._rejected = []
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Drop `seq`'s KV (recompute later) and put it first in line."""
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _grow_or_preempt(
        self, seq: Sequence, num_tokens: int, scheduled: set[int], out: SchedulerOutput
    ) -> bool:
        """Blocks for `num_tokens` more tokens of running `seq`, preempting the newest
        running sequences not yet in this step until they fit. False if `seq` itself
        had to go (it was the newest)."""
        while self.kv.allocate(seq.seq_id, seq.num_computed_tokens + num_tokens) is None:
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), seq)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _fit(self, seq: Sequence, num_tokens: int, computed: KVCacheBlocks = NO_BLOCKS) -> int:
        """Most of `num_tokens` next tokens of `seq` that fit without preempting."""
        held = len(self.kv.block_table(seq.seq_id)) + len(computed)
        reclaimed = sum(1 for b in computed.block_ids if self.kv.ref_count(b) == 0)
        slots = (held + self.kv.num_free_blocks - reclaimed) * self.kv.block_size
        start = seq.num_computed_tokens or len(computed) * self.kv.block_size
        return max(0, min(num_tokens, slots - start))

    def _admit(self, seq: Sequence, max_tokens: int, whole: bool) -> int:
        """Move the first waiting `seq` to running with up to `max_tokens` of its
        uncomputed tokens allocated (all of them or nothing if `whole`), after reusing
        prefix-cache blocks. Returns the tokens to compute (0: not admitted)."""
        computed, hit = NO_BLOCKS, 0
        if seq.params.prompt_logprobs is None:  # scoring needs every prompt position's logits
            computed, hit = self.kv.get_computed_blocks(seq.token_ids)
        remaining = seq.num_tokens - hit
        n = min(remaining, max_tokens)
        if whole and n < remaining:
            return 0
        n = self._fit(seq, n, computed)
        if n == 0 or (whole and n < remaining):
            return 0
        if self.kv.allocate(seq.seq_id, hit + n, computed) is None:
            return 0
        self.kv.record_prefix_lookup(seq.num_tokens, hit)
        self.waiting.popleft()
        seq.status = SeqStatus.RUNNING
        seq.num_computed_tokens = hit
        self.running.append(seq)
        return n
