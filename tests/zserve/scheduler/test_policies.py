"""Scheduling policies against a real BlockManager, no model: budget filling, chunk
splitting, decodes first, the live-sequence bound, preemption, never-fits."""

from __future__ import annotations

from tests.zserve.fakes import make_seq
from zserve.block_manager import BlockManager
from zserve.scheduler import (
    PrefillFirstScheduler,
    SchedulerOutput,
    SeqStatus,
    SplitFuseScheduler,
)


def _run(sched, out: SchedulerOutput) -> None:
    """What the engine does after a forward: record progress, 'sample' token 7."""
    sched.update(out)
    for c in out.chunks:
        if c.want_logits:
            seq = c.seq
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")


def test_splitfuse_fills_the_budget_and_splits_long_prompts() -> None:
    kv = BlockManager(64, 4)
    s = SplitFuseScheduler(kv, max_num_seqs=8, token_budget=16)
    long, short = make_seq(40), make_seq(5)
    s.add(long)
    s.add(short)
    out = s.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(long, 0, 16)]
    assert not out.chunks[0].want_logits
    _run(s, out)
    out = s.schedule()  # continue the long prompt, then start the short one
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(long, 16, 16)]
    _run(s, out)
    out = s.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(long, 32, 8), (short, 0, 5)]
    assert out.num_tokens == 13 and all(c.want_logits for c in out.chunks)
    _run(s, out)
    # Now both decode: one token each, decodes first.
    out = s.schedule()
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(long, 1), (short, 1)]


def test_splitfuse_puts_decodes_first_and_fuses_prompt_chunks() -> None:
    kv = BlockManager(256, 4)
    s = SplitFuseScheduler(kv, max_num_seqs=16, token_budget=32)
    decoders = [make_seq(3, max_tokens=50) for _ in range(4)]
    for d in decoders:
        s.add(d)
    _run(s, s.schedule())  # all four prompts in one forward (12 tokens)
    s.add(big := make_seq(100, max_tokens=2))
    sizes = []
    while big.num_computed_tokens < 100:
        out = s.schedule()
        assert [c.seq for c in out.chunks[:4]] == decoders  # every decode, every step
        assert all(c.num_tokens == 1 for c in out.chunks[:4])
        sizes.append(out.num_tokens)
        _run(s, out)
    # Every forward full (28 prompt tokens + 4 decodes) except the prompt's tail.
    assert sizes[:-1] == [32] * (len(sizes) - 1) and sizes[-1] == 4 + 100 - 28 * 3


def test_splitfuse_decodes_take_turns_when_they_outnumber_the_budget() -> None:
    """8 decoding sequences, a budget of 3: each decodes once every ceil(8/3) = 3 steps
    (the first 3 used to decode every step and the other 5 never)."""
    kv = BlockManager(256, 4)
    s = SplitFuseScheduler(kv, max_num_seqs=8, token_budget=3)
    seqs = [make_seq(2, max_tokens=100) for _ in range(8)]
    for seq in seqs:
        s.add(seq)
    # All prompts in at once (with 3 tokens a step the first decodes would fill every
    # forward and the rest would wait to be admitted), then the budget of 3.
    s.token_budget = 64
    _run(s, s.schedule())
    assert all(seq.num_remaining == 1 for seq in seqs)
    s.token_budget = 3
    served: list[list[int]] = []
    for _ in range(12):
        out = s.schedule()
        assert out.num_tokens == 3 and all(c.num_tokens == 1 for c in out.chunks)
        served.append([c.seq.seq_id for c in out.chunks])
        _run(s, out)
    ids = [seq.seq_id for seq in seqs]
    for start in range(len(served) - 2):  # any 3 consecutive steps serve everyone
        window = {sid for step in served[start : start + 3] for sid in step}
        assert window == set(ids), (start, served)
    counts = [sum(step.count(sid) for step in served) for sid in ids]
    assert max(counts) - min(counts) <= 1, counts  # 36 decodes over 8 sequences: 4 or 5


def test_max_num_seqs_bounds_live_sequences() -> None:
    kv = BlockManager(256, 4)
    s = SplitFuseScheduler(kv, max_num_seqs=3, token_budget=64)
    seqs = [make_seq(2, max_tokens=3) for _ in range(7)]
    for q in seqs:
        s.add(q)
    peak = 0
    while s.has_unfinished():
        out = s.schedule()
        peak = max(peak, len(s.running))
        assert len({c.seq.seq_id for c in out.chunks}) <= 3
        _run(s, out)
    assert peak == 3 and all(q.status is SeqStatus.FINISHED for q in seqs)
    assert kv.num_free_blocks == 256


def test_preemption_when_blocks_run_out_keeps_the_oldest_going() -> None:
    kv = BlockManager(6, 2)  # 12 token slots
    s = SplitFuseScheduler(kv, max_num_seqs=8, token_budget=64)
    a, b, c = (make_seq(3, max_tokens=6, first=i * 10) for i in range(3))
    for q in (a, b, c):
        s.add(q)
    preempted = []
    steps = 0
    while s.has_unfinished():
        out = s.schedule()
        preempted += out.preempted
        assert a not in out.preempted  # the oldest is never the victim
        _run(s, out)
        steps += 1
        assert steps < 200
    assert preempted and s.num_preemptions == len(preempted)
    assert preempted[0] is c  # newest first
    assert all(q.finish_reason == "length" and len(q.output_token_ids) == 6 for q in (a, b, c))
    assert kv.num_free_blocks == 6


def test_request_that_can_never_fit_finishes_with_an_error() -> None:
    kv = BlockManager(4, 4)  # 16 slots
    for sched in (SplitFuseScheduler(kv, 4, 8), PrefillFirstScheduler(kv, 4, 64)):
        big = make_seq(10, max_tokens=8)  # needs 17 slots
        sched.add(big)
        out = sched.schedule()
        assert out.finished == [big] and big.finish_reason == "error"
        assert "needs 5 KV blocks" in big.error and "has 4" in big.error
        assert not sched.has_unfinished() and not out.chunks


def test_prefill_first_runs_whole_prompts_before_decodes() -> None:
    kv = BlockManager(256, 4)
    s = PrefillFirstScheduler(kv, max_num_seqs=8, max_prefill_tokens=64)
    first = make_seq(30, max_tokens=5)
    s.add(first)
    out = s.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(first, 0, 30)]
    _run(s, out)
    out = s.schedule()
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(first, 1)]
    _run(s, out)
    a, b, c = make_seq(30), make_seq(30), make_seq(10)
    for q in (a, b, c):
        s.add(q)
    out = s.schedule()  # a prefill step: whole prompts that fit 64 tokens, no decodes
    assert [(q.seq, q.num_tokens) for q in out.chunks] == [(a, 30), (b, 30)]
    _run(s, out)
    out = s.schedule()
    assert [(q.seq, q.num_tokens) for q in out.chunks] == [(c, 10)]
    _run(s, out)
    out = s.schedule()
    assert [q.seq for q in out.chunks] == [first, a, b, c]
    assert all(q.num_tokens == 1 for q in out.chunks)


def test_prefill_first_preempts_and_recomputes_under_memory_pressure() -> None:
    kv = BlockManager(8, 2)
    s = PrefillFirstScheduler(kv, max_num_seqs=8, max_prefill_tokens=64)
    seqs = [make_seq(4, max_tokens=8, first=i) for i in range(3)]
    for q in seqs:
        s.add(q)
    for _ in range(300):
        if not s.has_unfinished():
            break
        _run(s, s.schedule())
    assert not s.has_unfinished() and s.num_preemptions > 0
    assert all(len(q.output_token_ids) == 8 for q in seqs)
    assert kv.num_free_blocks == 8


def test_abort_frees_blocks_at_once() -> None:
    kv = BlockManager(32, 4)
    s = SplitFuseScheduler(kv, 4, 64)
    q = make_seq(20)
    s.add(q)
    _run(s, s.schedule())
    assert kv.num_free_blocks == 32 - 5
    assert s.abort(q.request_id) is q and q.finish_reason == "abort"
    assert kv.num_free_blocks == 32 and not s.has_unfinished()
    assert s.abort("nope") is None
