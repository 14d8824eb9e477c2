"""Dynamic SplitFuse (DeepSpeed-FastGen): every forward carries `token_budget` tokens.

Order of filling one step's budget:

1. every running decode (one token each) — decode latency stays flat however many
   prompts arrive; when blocks run out, the newest running sequences are preempted
   (their KV dropped, recomputed later) so the older ones keep going. When more
   sequences decode than the budget holds (`token_budget < max_num_seqs`), the decodes
   take turns: each step starts after the last one served, so every sequence advances
   at least once every ceil(decoding / token_budget) steps;
2. running sequences still prefilling, continuing their prompt where the last chunk
   ended;
   With speculative decoding (`lookahead`), the decodes then get KV slots for draft
   tokens from what is left of the budget, never preempting for them: a decode with
   d drafts puts 1 + d tokens in the forward;
3. waiting sequences, first come first served, while live sequences < `max_num_seqs`:
   their prompt (after prefix-cache hits) is split so the forward is exactly full.

A long prompt therefore spans several forwards, each shared with the decodes, and
a forward is never mostly idle nor far over budget: throughput stays near the
hardware's best operating point while per-token latency stays bounded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from zserve.block_manager import BlockManager
from zserve.scheduler.interface import BaseScheduler, ScheduledChunk, SchedulerOutput
from zserve.scheduler.request import Sequence

log = logging.getLogger(__name__)


class SplitFuseScheduler(BaseScheduler):
    def __init__(
        self,
        kv: BlockManager,
        max_num_seqs: int,
        token_budget: int,
        lookahead: Callable[[Sequence], int] | None = None,
    ):
        """`lookahead(seq)`: draft tokens a decoding `seq` would verify this step (its
        drafter's proposal length; 0 for none). None: no speculative decoding."""
        super().__init__(kv, max_num_seqs)
        self.lookahead = lookahead
        if token_budget < 1:
            raise ValueError(f"token_budget is {token_budget}; it must be >= 1")
        self.token_budget = token_budget
        self._last_decoded = -1  # seq_id of the last decode served when they take turns
        if token_budget < max_num_seqs:
            log.warning(
                "token_budget %d < max_num_seqs %d: when more sequences decode than the "
                "budget holds they take turns and no prompt is prefilled; raise "
                "token_budget to at least max_num_seqs for steady decode latency",
                token_budget,
                max_num_seqs,
            )

    def schedule(self) -> SchedulerOutput:
        out = self._new_output()
        budget = self.token_budget
        scheduled: set[int] = set()

        # 1. decodes, oldest first; in turns when they outnumber the budget.
        decodes = [seq for seq in self.running if seq.num_remaining == 1]
        if len(decodes) > budget:
            ids = [seq.seq_id for seq in decodes]
            if self._last_decoded in ids:  # start right after it
                turn = ids.index(self._last_decoded) + 1
            else:  # it finished: after where it was
                turn = next((i for i, sid in enumerate(ids) if sid > self._last_decoded), 0)
            decodes = decodes[turn:] + decodes[:turn]
        for seq in decodes:
            if budget == 0:
                break
            if seq not in self.running:
                continue  # preempted for an earlier decode's blocks
            if not self._grow_or_preempt(seq, 1, scheduled, out):
                continue  # seq was the newest unscheduled one and went itself
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
            scheduled.add(seq.seq_id)
            self._last_decoded = seq.seq_id
            budget -= 1

        if self.lookahead is not None:
            budget = self._reserve_lookahead(out, budget)

        # 2. prefills already running, oldest first.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.seq_id in scheduled or seq not in self.running:
                continue
            n = self._fit(seq, min(seq.num_remaining, budget))
            if n == 0:
                # No free block at all: make room for one block's worth (or go itself).
                n = min(seq.num_remaining, budget, self.kv.block_size)
                if not self._grow_or_preempt(seq, n, scheduled, out):
                    continue
            elif self.kv.allocate(seq.seq_id, seq.num_computed_tokens + n) is None:
                continue  # _fit said it fits; cannot happen, but never schedule unbacked
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            scheduled.add(seq.seq_id)
            budget -= n

        # 3. new (or preempted) sequences. Not in a step that had to preempt: the blocks
        # just freed are for the sequences already running.
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            n = self._admit(seq, budget, whole=False)
            if n == 0:
                break
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            scheduled.add(seq.seq_id)
            budget -= n
        return out

    def _reserve_lookahead(self, out: SchedulerOutput, budget: int) -> int:
        """Give the decode chunks of `out` KV slots for their drafts, in order, from
        `budget` and the free blocks (no preemption); returns the budget left."""
        assert self.lookahead is not None
        for i, c in enumerate(out.chunks):
            if budget == 0:
                break
            seq = c.seq
            # Verifying d drafts emits up to d + 1 tokens: never more than max_tokens.
            room = seq.params.max_tokens - len(seq.output_token_ids) - 1
            want = min(self.lookahead(seq), budget, room)
            if want <= 0:
                continue
            n = self._fit(seq, 1 + want) - 1
            if n <= 0 or self.kv.allocate(seq.seq_id, seq.num_computed_tokens + 1 + n) is None:
                continue
            out.chunks[i] = ScheduledChunk(seq, c.start, c.num_tokens, num_lookahead=n)
            budget -= n
        return budget
