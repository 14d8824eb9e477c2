"""Speculative decoding on real SmolLM2 weights: greedy output of the n-gram and the
self-draft drafters equals plain decoding's token for token (text and finish reason
too), for one SplitFuse batch mixing a long prompt split across forwards, chat prompts,
a prompt the model repeats (so n-gram drafts are proposed and accepted), max_tokens
cutoffs and a stop string; every KV block comes back."""

from __future__ import annotations

import pytest

from tests.utils.models import smollm2_dir
from zserve.engine import Engine
from zserve.sampling import SamplingParams
from zserve.tokenizer import Tokenizer

TOKEN_BUDGET = 48


@pytest.fixture(scope="module")
def requests() -> list[tuple[str, SamplingParams]]:
    from ztrain.data import load_plays

    plays = dict(load_plays())
    text = plays["Hamlet"]
    i = text.index("To be, or not to be")
    hamlet = text[i : i + 450]  # ~110 tokens: longer than the token budget
    j = plays["Macbeth"].index("To-morrow, and to-morrow")
    macbeth = plays["Macbeth"][j : j + 120]
    tok = Tokenizer(smollm2_dir())

    def chat(msg: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": msg}])

    def greedy(n: int, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, **kw)

    reqs = [
        (chat(f"Repeat this text exactly:\n\n{macbeth}"), greedy(28)),
        (hamlet, greedy(20)),
        (chat("What is the capital of France?"), greedy(24)),
        (chat("Name three colors."), greedy(9)),  # cut off by max_tokens mid-draft
        (macbeth, greedy(24, stop=("\n",))),  # a stop string
        ("Friends, Romans", greedy(3)),
    ]
    assert max(len(tok.encode(p)) for p, _ in reqs) > 2 * TOKEN_BUDGET
    return reqs


def _run(requests, **config) -> tuple[dict[str, tuple], dict]:
    engine = Engine(
        smollm2_dir(), num_blocks=128, block_size=16, token_budget=TOKEN_BUDGET, **config
    )
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    res: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            r = res.setdefault(o.request_id, [[], "", None])
            r[0] += o.token_ids
            r[1] += o.text
            r[2] = o.finish_reason
    s = engine.stats()
    assert s["free_blocks"] == s["total_blocks"] == 128
    return {k: tuple(v) for k, v in res.items()}, s


@pytest.fixture(scope="module")
def plain(requests) -> dict[str, tuple]:
    res, _ = _run(requests)
    assert {r[2] for r in res.values()} == {"stop", "length"}
    return res


def test_ngram_greedy_output_is_plain_decoding(requests, plain) -> None:
    res, s = _run(requests, speculative="ngram", num_speculative_tokens=4, prompt_lookup_min=2)
    assert res == plain
    assert s["spec_accepted_tokens"] > 0  # the repeated text drafts itself
    assert s["spec_emitted_tokens"] == s["spec_accepted_tokens"] + s["spec_verify_steps"]


def test_self_draft_greedy_output_is_plain_decoding(requests, plain) -> None:
    res, s = _run(requests, speculative="self-draft", draft_layers=28, num_speculative_tokens=3)
    assert res == plain
    assert s["spec_proposed_tokens"] > 0
    assert s["spec_accepted_tokens"] > 0
