"""Speculative decoding in the engine over the model-free fake runner (fakes.py), whose
"KV" is a hash chain read back through the block tables: a draft slot that leaked
into the sequence (a rejected token's KV kept, a block not rolled back, a shared block
written) changes every later token. Drafts come from an oracle that knows the greedy
continuation and corrupts it at a random point, so every acceptance length 0..k occurs;
and from the n-gram drafter on repetitive prompts. Outputs must equal plain decoding's
token for token, text and finish reason included; blocks must all come back."""

from __future__ import annotations

import random

import pytest

from tests.zserve.fakes import (
    VOCAB,
    FakeRunner,
    FakeTokenizer,
    reference_generate,
)
from zserve.config import EngineConfig
from zserve.engine import Engine
from zserve.sampling import SamplingParams
from zserve.speculative import DraftRequest

GREEDY = dict(temperature=0)


class AllLogitsRunner(FakeRunner):
    """The FakeRunner (it honours `all_logits`, which a verified draft needs)."""


class OracleDrafter:
    """Proposes the true greedy continuation, wrong from a random index on (seeded by the
    sequence's length, so a run is reproducible)."""

    name = "oracle"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.proposed = 0

    def max_draft(self, seq, k: int) -> int:
        return k

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            seq = r.seq
            done = len(seq.output_token_ids)
            truth = reference_generate(seq.prompt_token_ids, done + r.max_tokens)[done:]
            rng = random.Random(self.seed * 1_000_003 + seq.seq_id * 7919 + seq.num_tokens)
            good = rng.randint(0, r.max_tokens)
            draft = truth[:good] + [(t + 1) % VOCAB for t in truth[good:]]
            out.append(draft)
            self.proposed += len(draft)
        return out


class GreedyDrafter:
    """Proposes the fake model's greedy continuation of the sequence as it stands (the
    sampled tokens included), so a sampled request's drafts are often accepted."""

    name = "greedy"

    def max_draft(self, seq, k: int) -> int:
        return k

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [reference_generate(r.seq.token_ids, r.max_tokens) for r in requests]


def _engine(drafter=None, num_blocks=400, eos=(), **config) -> Engine:
    runner = AllLogitsRunner(num_blocks, 4)
    base = dict(block_size=4, num_blocks=num_blocks, token_budget=16, max_num_seqs=8)
    cfg = EngineConfig(**{**base, **config})
    engine = Engine.from_parts(runner, FakeTokenizer(eos), cfg, "fake", drafter=drafter)
    runner.kv = engine.kv
    return engine


def _workload(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    common = [rng.randrange(26) for _ in range(shared)]
    return [common + [rng.randrange(26) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _run(engine: Engine, prompts, params) -> dict[str, list]:
    """Run to completion, checking after every step that each running sequence holds
    exactly the blocks its computed tokens need (rejected drafts' slots went back)."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    res: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            r = res.setdefault(o.request_id, [[], "", None])
            r[0] += o.token_ids
            r[1] += o.text
            if o.finished:
                r[2] = o.finish_reason
        for seq in engine.scheduler.running:
            held = len(engine.kv.block_table(seq.seq_id))
            assert held == engine.kv.blocks_needed(seq.num_computed_tokens), seq.request_id
            assert seq.num_remaining >= 1
    return res


def _assert_drained(engine: Engine) -> None:
    s = engine.stats()
    assert s["free_blocks"] == s["total_blocks"]
    assert s["num_running"] == s["num_waiting"] == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks", [400, 24])  # 24 blocks x 4 slots: preemption
@pytest.mark.parametrize("k", [1, 3, 6])
def test_oracle_drafts_give_plain_greedy_output(prefix_caching, num_blocks, k) -> None:
    prompts = _workload(16, seed=3, shared=9)
    params = [SamplingParams(max_tokens=1 + (5 * i) % 23, **GREEDY) for i in range(16)]
    drafter = OracleDrafter(seed=k)
    engine = _engine(
        drafter,
        num_blocks=num_blocks,
        prefix_caching=prefix_caching,
        num_speculative_tokens=k,
    )
    res = _run(engine, prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        assert res[f"r{i}"][0] == reference_generate(p, sp.max_tokens), f"request r{i}"
        assert res[f"r{i}"][2] == "length"
    s = engine.stats()
    _assert_drained(engine)
    assert s["spec_proposed_tokens"] == drafter.proposed > 0
    # Every acceptance length occurs: some drafts fully right, some rejected at once.
    assert 0 < s["spec_accepted_tokens"] < s["spec_proposed_tokens"]
    assert s["spec_emitted_tokens"] == s["spec_accepted_tokens"] + s["spec_verify_steps"]
    if num_blocks == 24:
        assert s["num_preempted"] > 0


def test_speculation_saves_forwards_and_respects_the_budget() -> None:
    prompts = _workload(6, seed=5)
    params = [SamplingParams(max_tokens=30, **GREEDY)] * 6
    plain = _engine()
    _run(plain, prompts, params)

    class Perfect(OracleDrafter):
        def propose(self, requests):
            out = []
            for r in requests:
                done = len(r.seq.output_token_ids)
                out.append(reference_generate(r.seq.prompt_token_ids, done + r.max_tokens)[done:])
            return out

    spec = _engine(Perfect(), num_speculative_tokens=4)
    res = _run(spec, prompts, params)
    assert all(res[f"r{i}"][0] == reference_generate(p, 30) for i, p in enumerate(prompts))
    s = spec.stats()
    assert s["spec_acceptance_rate"] == 1.0
    assert s["num_steps"] < plain.stats()["num_steps"] * 0.6
    assert max(spec.runner.forward_sizes) <= 16  # drafts count against token_budget
    _assert_drained(spec)


def test_stop_tokens_stop_strings_and_eos_hold_inside_accepted_drafts() -> None:
    """A stop inside an accepted draft ends the request there: nothing past it leaks."""
    prompts = _workload(12, seed=7)
    eos = (3,)
    params = [
        SamplingParams(
            max_tokens=25,
            stop=("q", "zz") if i % 3 == 0 else (),
            stop_token_ids=(5,) if i % 3 == 1 else (),
            **GREEDY,
        )
        for i in range(12)
    ]
    plain = _run(_engine(eos=eos), prompts, params)
    spec_engine = _engine(OracleDrafter(seed=1), eos=eos, num_speculative_tokens=5)
    spec = _run(spec_engine, prompts, params)
    assert spec == plain
    assert {r[2] for r in plain.values()} == {"stop", "length"}
    _assert_drained(spec_engine)


def test_ngram_drafts_on_repetitive_prompts_and_sampled_requests_fall_back() -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(26) for _ in range(6)] * 5 for _ in range(6)]
    params = [SamplingParams(max_tokens=20, **GREEDY) for _ in range(5)]
    params.append(SamplingParams(max_tokens=20, temperature=0.8, seed=4))
    plain = _run(_engine(), prompts, params)
    engine = _engine(speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    spec = _run(engine, prompts, params)
    assert spec == plain  # the sampled request too: it was not speculated
    s = engine.stats()
    assert s["spec_proposed_tokens"] > 0
    _assert_drained(engine)


def test_unseeded_sampled_requests_are_speculated_and_complete() -> None:
    """Sampled requests without a seed get drafts checked by sampled acceptance:
    drafts are proposed and some accepted, every request ends with its tokens, no block
    is lost (the distribution itself: test_speculative_units)."""
    prompts = _workload(4, seed=12)
    params = [SamplingParams(max_tokens=20, temperature=0.7, ignore_eos=True)] * 4
    engine = _engine(GreedyDrafter(), num_speculative_tokens=3)
    out = _run(engine, prompts, params)
    assert all(len(out[f"r{i}"][0]) == 20 and out[f"r{i}"][2] == "length" for i in range(4))
    s = engine.stats()
    assert s["spec_proposed_tokens"] > 0 and s["spec_accepted_tokens"] > 0, s
    _assert_drained(engine)


def test_token_budget_smaller_than_the_decodes() -> None:
    """More decodes than budget: they take turns, and drafts get only what is left."""
    prompts = _workload(8, seed=13)
    params = [SamplingParams(max_tokens=12, **GREEDY)] * 8
    engine = _engine(OracleDrafter(), token_budget=5, num_speculative_tokens=4)
    res = _run(engine, prompts, params)
    assert all(res[f"r{i}"][0] == reference_generate(p, 12) for i, p in enumerate(prompts))
    assert max(engine.runner.forward_sizes) <= 5
    _assert_drained(engine)
