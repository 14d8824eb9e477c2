"""Sampler and SamplingParams: greedy, temperature, top-k, top-p, seeds, validation;
stop strings / stop tokens end requests through the engine (model-free fakes)."""

from __future__ import annotations

import pytest
import torch

from tests.zserve.fakes import make_engine, reference_generate, run_to_completion
from zserve.config import SEED_MAX, SEED_MIN
from zserve.sampling import MIN_TEMPERATURE, Sampler, SamplingParams


def _logits(n: int = 1, v: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 2


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    sampler = Sampler(seed)
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([sampler.sample(logits, [params], [gen])[0] for _ in range(n)])


def test_greedy_and_top_k_1_are_argmax() -> None:
    logits = _logits(4)
    want = logits.argmax(-1).tolist()
    s = Sampler()
    for p in (SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=1.5)):
        assert s.sample(logits, [p] * 4, [None] * 4) == want


def test_tiny_temperatures_are_greedy_and_fail_no_neighbour() -> None:
    # logits / 1e-45 overflow to inf and softmax gives NaN: below MIN_TEMPERATURE is greedy
    logits = _logits(3) * 20
    want = logits.argmax(-1).tolist()
    s = Sampler()
    for t in (1e-45, 1e-38, 1e-6):
        p = SamplingParams(temperature=t)
        assert p.greedy
        assert s.sample(logits, [p] * 3, [None] * 3) == want
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    # through the engine, beside a sampled request that must not be failed with it
    prompt = [3, 1, 4, 1, 5]
    engine = make_engine()
    engine.add_request("tiny", prompt, SamplingParams(max_tokens=6, temperature=1e-45))
    engine.add_request("other", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=1))
    res = run_to_completion(engine)
    assert res["tiny"][0] == reference_generate(prompt, 6)
    assert res["tiny"][2] == res["other"][2] == "length"


def test_seeds_span_the_signed_64_bit_range() -> None:
    s = Sampler()
    logits = _logits(1, v=1000)
    for seed in (SEED_MIN, -1, 0, SEED_MAX):
        p = SamplingParams(temperature=1.0, seed=seed)
        draws = [s.sample(logits, [p], [s.generator_for(p)]) for _ in range(2)]
        assert draws[0] == draws[1]  # each request's own generator, seeded alike
    for seed in (SEED_MAX + 1, SEED_MIN - 1, 2**64, True):
        with pytest.raises(ValueError, match=r"`seed` is .*it must be an integer in \["):
            SamplingParams(seed=seed)


def test_seed_reproduces_and_differs_across_seeds() -> None:
    engine_a, engine_b = make_engine(), make_engine()
    prompt = [3, 1, 4, 1, 5, 9]
    for e in (engine_a, engine_b):
        e.add_request("x", prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=42))
        e.add_request("y", prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=43))
    # engine_b also serves unseeded neighbours: a seeded request must not notice them.
    for i in range(3):
        engine_b.add_request(f"n{i}", prompt, SamplingParams(max_tokens=12, temperature=1.0))
    a, b = run_to_completion(engine_a), run_to_completion(engine_b)
    assert a["x"][0] == b["x"][0] and a["y"][0] == b["y"][0]
    assert a["x"][0] != a["y"][0]


def test_temperature_matches_softmax_frequencies() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    for t in (0.5, 2.0):
        counts = torch.bincount(_draws(logits, SamplingParams(temperature=t), n), minlength=4)
        want = torch.softmax(logits[0] / t, -1)
        # 4000 draws: binomial sd <= 0.008; 0.03 is > 3.5 sd.
        assert torch.allclose(counts / n, want, atol=0.03), (t, counts / n, want)


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -2.0]])
    drawn = set(_draws(logits, SamplingParams(top_k=3), 500).tolist())
    assert drawn == {0, 1, 2}
    probs = torch.softmax(logits[0], -1)  # 0.50, 0.30, 0.18, ...
    top_p = float(probs[:2].sum()) - 1e-3  # just under the top two: keeps exactly two
    drawn = _draws(logits, SamplingParams(top_p=top_p), 2000)
    assert set(drawn.tolist()) == {0, 1}
    frac0 = float((drawn == 0).float().mean())
    assert abs(frac0 - float(probs[0] / probs[:2].sum())) < 0.04  # renormalized


def test_stop_strings_cut_text_before_them() -> None:
    prompt = [2, 7, 1, 8, 2, 8]
    ref = reference_generate(prompt, 10)
    letters = "".join(chr(ord("a") + t % 26) for t in ref)
    stop = letters[4:6]
    cut = letters.index(stop)
    engine = make_engine()
    engine.add_request("s", prompt, SamplingParams(max_tokens=10, temperature=0, stop=[stop]))
    engine.add_request("n", prompt, SamplingParams(max_tokens=10, temperature=0))
    res = run_to_completion(engine)
    assert res["s"][1] == letters[:cut] and res["s"][2] == "stop"
    assert res["n"][1] == letters and res["n"][2] == "length"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-3), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(seed="x"), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_validation_errors_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"`{field}` is"):
        SamplingParams(**kwargs)


def test_lists_are_accepted_for_tuple_fields() -> None:
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1], top_k=-1)
    assert p.stop == ("a", "b") and p.stop_token_ids == (1,) and p.top_k == 0
    assert SamplingParams(stop="x").stop == ("x",)
