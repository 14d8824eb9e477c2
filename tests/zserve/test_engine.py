"""The engine over the model-free `FakeRunner` (see fakes.py): paging, prefix
sharing and preemption must not change a single generated token; blocks come back."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.zserve.fakes import make_engine, reference_generate, run_to_completion
from zserve.sampling import SamplingParams

GREEDY = dict(temperature=0)


def _workload(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    """n prompts of 1..40 tokens; the first `shared` tokens common to all."""
    rng = random.Random(seed)
    common = [rng.randrange(26) for _ in range(shared)]
    return [common + [rng.randrange(26) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("policy", ["splitfuse", "prefill-first"])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks", [400, 24])  # 24 blocks x 4 slots: forced preemption
def test_outputs_match_unpaged_reference(policy, prefix_caching, num_blocks) -> None:
    engine = make_engine(
        num_blocks=num_blocks,
        block_size=4,
        policy=policy,
        token_budget=16,
        max_num_seqs=8,
        prefix_caching=prefix_caching,
    )
    prompts = _workload(20, seed=1, shared=13)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=1 + i % 9, **GREEDY))
    res = run_to_completion(engine)
    for i, p in enumerate(prompts):
        assert res[f"r{i}"][0] == reference_generate(p, 1 + i % 9), f"request r{i}"
        assert res[f"r{i}"][2] == "length"
    s = engine.stats()
    assert s["free_blocks"] == s["total_blocks"] == num_blocks
    assert s["num_running"] == s["num_waiting"] == 0
    if num_blocks == 24:
        assert s["num_preempted"] > 0
    if prefix_caching:
        assert s["prefix_hits"] > 0
    else:
        assert s["prefix_hits"] == s["prefix_queries"] == 0


def test_splitfuse_forwards_are_filled_to_the_budget() -> None:
    engine = make_engine(
        num_blocks=400, policy="splitfuse", token_budget=16, max_num_seqs=32, prefix_caching=False
    )
    for i, p in enumerate(_workload(12, seed=2)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4, **GREEDY))
    run_to_completion(engine)
    sizes = engine.runner.forward_sizes
    assert max(sizes) == 16
    # While prompt tokens remain the forward is full; it only runs short at the tail.
    full = sum(1 for s in sizes if s == 16)
    assert full >= sum(sizes) // 16 - 2


def test_abort_frees_blocks_and_unknown_abort_is_a_noop() -> None:
    engine = make_engine(num_blocks=64)
    engine.add_request("a", [1] * 30, SamplingParams(max_tokens=8, **GREEDY))
    engine.add_request("b", [2] * 30, SamplingParams(max_tokens=8, **GREEDY))
    early = [o for _ in range(2) for o in engine.step()]
    assert engine.stats()["free_blocks"] < 64
    engine.abort("a")
    engine.abort("a")
    engine.abort("never-seen")
    res = run_to_completion(engine)
    assert set(res) == {"b"}
    assert len([t for o in early if o.request_id == "b" for t in o.token_ids] + res["b"][0]) == 8
    assert engine.stats()["free_blocks"] == 64


def test_thousand_tiny_requests_leave_the_allocator_as_it_was() -> None:
    engine = make_engine(num_blocks=64, block_size=4, max_num_seqs=16, token_budget=32)
    start = engine.stats()["free_blocks"]
    rng = random.Random(0)
    for i in range(1000):
        prompt = [rng.randrange(26) for _ in range(rng.randint(1, 6))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 3), **GREEDY))
        if i % 7 == 0:
            engine.step()
        if i % 50 == 0:
            engine.abort(f"r{i}")
    run_to_completion(engine)
    assert engine.stats()["free_blocks"] == start == 64
    assert engine.kv._seqs == {}  # no sequence holds anything


def test_request_validation_names_the_field() -> None:
    engine = make_engine(num_blocks=64)  # FakeRunner.max_model_len = 512
    engine.add_request("x", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id 'x' is already"):
        engine.add_request("x", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("y", "", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"prompt \(500 tokens\) \+ max_tokens \(13\) = 513"):
        engine.add_request("y", [1] * 500, SamplingParams(max_tokens=13))
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("y", [1], {"max_tokens": 3})


def test_kv_cache_caps_max_model_len_and_too_big_requests_are_refused_up_front() -> None:
    # 16 slots hold a 17-token sequence (its last token is never fed back), whatever the
    # model's own context (FakeRunner: 512)
    engine = make_engine(num_blocks=4, block_size=4)
    assert engine.max_model_len == 17
    with pytest.raises(ValueError, match=r"max_tokens \(8\) = 20 exceeds max_model_len 17"):
        engine.add_request("big", [1] * 12, SamplingParams(max_tokens=8, **GREEDY))
    engine.add_request("full", [1] * 12, SamplingParams(max_tokens=5, **GREEDY))
    engine.add_request("ok", [1] * 4, SamplingParams(max_tokens=4, **GREEDY))
    res = run_to_completion(engine)
    assert set(res) == {"full", "ok"}
    assert res["full"][0] == reference_generate([1] * 12, 5) and res["full"][2] == "length"
    assert res["ok"][2] == "length"
    assert engine.stats()["free_blocks"] == 4
    # a runner whose own limit is the smaller one keeps it
    assert make_engine(num_blocks=1000, block_size=4).max_model_len == 512


def test_eos_and_stop_token_ids_end_requests() -> None:
    prompt = [3, 1, 4, 1, 5]
    ref = reference_generate(prompt, 6)
    engine = make_engine(eos=(ref[2],))
    engine.add_request("eos", prompt, SamplingParams(max_tokens=6, **GREEDY))
    engine.add_request("ign", prompt, SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY))
    engine.add_request(
        "stop", prompt, SamplingParams(max_tokens=6, stop_token_ids=[ref[1]], **GREEDY)
    )
    res = run_to_completion(engine)
    assert res["eos"][0] == ref[:3] and res["eos"][2] == "stop"
    assert res["ign"][0] == ref and res["ign"][2] == "length"
    assert res["stop"][0] == ref[:2] and res["stop"][2] == "stop"
    # The stop token is in token_ids but not in the text.
    assert res["stop"][1] == engine.tokenizer.decode(ref[:1])


@settings(max_examples=25, deadline=None)
@given(
    policy=st.sampled_from(["splitfuse", "prefill-first"]),
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4]),
    token_budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    reqs=st.lists(
        st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=12), st.integers(1, 5)),
        min_size=1,
        max_size=8,
    ),
)
def test_any_workload_finishes_exactly_and_returns_every_block(
    policy, num_blocks, block_size, token_budget, max_num_seqs, prefix_caching, reqs
) -> None:
    """Whatever the cache size, budget and live bound: no hang, no crash, outputs equal
    the unpaged reference (requests that can never fit are refused up front), blocks back."""
    engine = make_engine(
        num_blocks=num_blocks,
        block_size=block_size,
        policy=policy,
        token_budget=token_budget,
        max_num_seqs=max_num_seqs,
        prefix_caching=prefix_caching,
    )
    fits = [-(-(len(p) + n - 1) // block_size) <= num_blocks for p, n in reqs]
    for i, (prompt, n) in enumerate(reqs):
        params = SamplingParams(max_tokens=n, **GREEDY)
        if fits[i]:
            engine.add_request(f"r{i}", prompt, params)
        else:
            with pytest.raises(ValueError, match="exceeds max_model_len"):
                engine.add_request(f"r{i}", prompt, params)
    res = run_to_completion(engine, max_steps=20_000)
    assert set(res) == {f"r{i}" for i in range(len(reqs)) if fits[i]}
    for i, (prompt, n) in enumerate(reqs):
        if fits[i]:
            assert res[f"r{i}"][0] == reference_generate(prompt, n)
    assert engine.stats()["free_blocks"] == num_blocks
