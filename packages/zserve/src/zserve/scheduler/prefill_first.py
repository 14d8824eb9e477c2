"""Continuous batching with prefill priority (vLLM before chunked prefill).

Requests join and leave the batch every step, but a step is either a *prefill*
step — whole prompts (never split), as many as fit in `max_prefill_tokens` and the
free blocks — or a *decode* step that advances every running sequence by one token.
Whenever a request is waiting and fits, its prefill runs first, so every arrival
stalls all running decodes for a whole prompt's forward: the latency spikes that
Dynamic SplitFuse removes.
"""

from __future__ import annotations

from zserve.block_manager import BlockManager
from zserve.scheduler.interface import BaseScheduler, ScheduledChunk, SchedulerOutput


class PrefillFirstScheduler(BaseScheduler):
    def __init__(self, kv: BlockManager, max_num_seqs: int, max_prefill_tokens: int):
        super().__init__(kv, max_num_seqs)
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens is {max_prefill_tokens}; it must be >= 1")
        # Must hold the longest prompt, or that prompt could never run.
        self.max_prefill_tokens = max_prefill_tokens

    def schedule(self) -> SchedulerOutput:
        out = self._new_output()
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit(seq, budget, whole=True)
            if n == 0:
                break
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        if out.chunks:
            return out

        scheduled: set[int] = set()
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if not self._grow_or_preempt(seq, seq.num_remaining, scheduled, out):
                break
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, seq.num_remaining))
            scheduled.add(seq.seq_id)
            i += 1
        return out
