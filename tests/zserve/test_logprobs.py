"""Log-probabilities of the engine on real SmolLM2 weights equal transformers'
``log_softmax`` of its logits: the generated tokens' (`logprobs`) and the prompt's
(`prompt_logprobs`, OpenAI's echo), with the prompt split across forwards and scored
once more with max_tokens 0. Tolerance: 1e-4 absolute (fp32 on both sides; the two
models differ by the order of their float sums only)."""

from __future__ import annotations

import pytest
import torch

from tests.utils.models import smollm2_dir
from zserve.engine import Engine
from zserve.sampling import SamplingParams, gather_logprobs

ATOL = 1e-4
PROMPT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"


def _run(engine: Engine, prompt: str, params: SamplingParams) -> dict:
    engine.add_request("r", prompt, params)
    got: dict = {"tokens": [], "lps": [], "prompt": None}
    while engine.has_unfinished():
        for out in engine.step():
            got["tokens"] += out.token_ids
            got["lps"] += out.logprobs or []
            if out.prompt_logprobs is not None:
                assert got["prompt"] is None  # sent once
                got["prompt"] = out.prompt_logprobs
            got["reason"] = out.finish_reason
    return got


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir(), torch_dtype=torch.float32).eval()


def test_logprobs_equal_transformers_log_softmax(hf_model) -> None:
    # token_budget 8: the prompt's logits come from several forwards
    engine = Engine(smollm2_dir(), max_model_len=256, token_budget=8, max_num_seqs=4)
    ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=3, prompt_logprobs=2)
    got = _run(engine, PROMPT, params)
    assert len(got["tokens"]) == len(got["lps"]) == 5
    full = ids + got["tokens"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), dim=-1)
    # generated: token i of the output is predicted at position len(ids) - 1 + i
    for i, (tok, lp) in enumerate(zip(got["tokens"], got["lps"], strict=True)):
        row = ref[len(ids) - 1 + i]
        assert lp.token_id == tok == int(row.argmax())  # greedy: the likeliest token
        assert abs(lp.logprob - float(row[tok])) < ATOL
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert lp.top[0][1] == pytest.approx(lp.logprob)
        torch.testing.assert_close(
            torch.tensor([v for _, v in lp.top]), row.topk(3).values, atol=ATOL, rtol=0
        )
    # prompt: the first token has no logprob, token j is predicted at j - 1
    prompt_lp = got["prompt"]
    assert len(prompt_lp) == len(ids) and prompt_lp[0] is None
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    have = torch.tensor([e.logprob for e in prompt_lp[1:]])
    torch.testing.assert_close(have, want, atol=ATOL, rtol=0)
    assert all(len(e.top) == 2 for e in prompt_lp[1:])

    # max_tokens 0: the prompt's scores only, the same numbers, no token
    scored = _run(engine, PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert scored["tokens"] == [] and scored["reason"] == "length"
    torch.testing.assert_close(
        torch.tensor([e.logprob for e in scored["prompt"][1:]]), have, atol=1e-5, rtol=0
    )
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_logprobs_are_of_the_raw_distribution_not_the_tempered_one() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    (lp,) = gather_logprobs(logits, [1], [2])
    assert lp.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))
    assert [t for t, _ in lp.top] == [0, 1]
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
