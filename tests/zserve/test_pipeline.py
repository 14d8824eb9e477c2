"""`zserve.pipeline` on real SmolLM2: completions, stop strings on real text, and the
static-batch baseline agreeing with the engine under greedy decoding."""

from __future__ import annotations

import pytest

from tests.utils.models import smollm2_dir
from zserve.pipelines import pipeline

PROMPTS = [
    "To be, or not to be: that is the question:",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Now is the winter of our discontent made glorious summer by this sun of York;",
]


@pytest.fixture(scope="module")
def pipe():
    return pipeline(smollm2_dir(), token_budget=32, num_blocks=64, max_num_seqs=4)


def test_pipeline_completes_prompts(pipe) -> None:
    out = pipe(PROMPTS, max_tokens=8, temperature=0)
    assert len(out) == 3
    tok = pipe.engine.tokenizer
    for c in out:
        assert 1 <= len(c.token_ids) <= 8 and c.finish_reason in ("stop", "length")
        assert c.text == tok.decode(c.token_ids) and c.text
    assert out[1].text.lstrip().startswith("The capital of France is Paris")
    assert pipe.engine.stats()["free_blocks"] == 64
    # A second call on the same pipeline gives the same greedy text.
    assert [c.text for c in pipe(PROMPTS[:1], max_tokens=8, temperature=0)] == [out[0].text]


def test_stop_string_on_real_text(pipe) -> None:
    full = pipe(PROMPTS[2], max_tokens=12, temperature=0, ignore_eos=True)[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = pipe(PROMPTS[2], max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_a_long_chunked_prefill_is_progress(pipe, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill steps return no output but compute their chunk: a prompt of many chunks
    (here ~3 forwards of 32 tokens with a no-progress limit of 1) must not be taken for
    a stuck engine."""
    import zserve.pipelines as zp

    monkeypatch.setattr(zp, "_MAX_IDLE_STEPS", 1)
    prompt = " ".join([PROMPTS[0]] * 8)  # ~100 tokens
    assert len(pipe.engine.tokenizer.encode(prompt)) > 3 * 32
    out = pipe(prompt, max_tokens=2, temperature=0)[0]
    assert out.finish_reason in ("stop", "length") and out.token_ids


def test_unknown_sampling_option_is_a_type_error(pipe) -> None:
    with pytest.raises(TypeError, match="max_new_tokens"):
        pipe("hi", max_new_tokens=3)
    with pytest.raises(ValueError, match="max_tokens"):
        pipe("hi", max_tokens=0)


def test_static_baseline_matches_engine_greedy(pipe) -> None:
    static = pipeline(smollm2_dir(), policy="static", max_num_seqs=4)
    want = pipe(PROMPTS, max_tokens=6, temperature=0, ignore_eos=True)
    got = static(PROMPTS, max_tokens=6, temperature=0, ignore_eos=True)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.text for c in got] == [c.text for c in want]


def test_static_baseline_refuses_what_it_cannot_honour() -> None:
    """logprobs and structured output (response_format) are errors naming the field and
    the policies that serve them, never ignored."""
    from zserve.config import EngineConfig
    from zserve.sampling import SamplingParams
    from zserve.static_batch import StaticBatchEngine
    from zserve.structured.spec import json_object

    engine = StaticBatchEngine(smollm2_dir(), EngineConfig(policy="static", max_num_seqs=2))
    with pytest.raises(ValueError, match=r"json_object: the static baseline.*'splitfuse'"):
        engine.add_request("a", "hi", SamplingParams(structured=json_object()))
    with pytest.raises(ValueError, match="logprobs: the static baseline"):
        engine.add_request("b", "hi", SamplingParams(logprobs=1))
    assert not engine.has_unfinished()
