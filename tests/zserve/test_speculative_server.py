"""`z serve --speculative ngram` end to end over HTTP: the completion equals plain
greedy decoding's, and /metrics and /health carry the draft counters."""

from __future__ import annotations

import httpx

from tests.utils.models import smollm2_dir
from tests.zserve.server.conftest import serving
from zserve.engine import Engine
from zserve.sampling import SamplingParams
from zserve.server.prometheus import parse_prometheus

PROMPT = (
    "Tomorrow, and tomorrow, and tomorrow,\nCreeps in this petty pace from day to day\n\n"
    "The same passage, copied out:\n\nTomorrow, and tomorrow,"
)


def test_server_with_ngram_speculation_matches_plain_and_reports_acceptance() -> None:
    plain = Engine(smollm2_dir(), max_model_len=512)
    plain.add_request("p", PROMPT, SamplingParams(max_tokens=16, temperature=0))
    text = ""
    while plain.has_unfinished():
        text += "".join(o.text for o in plain.step())

    engine = Engine.from_parts(
        plain.runner,
        plain.tokenizer,
        plain.config.model_copy(update={"speculative": "ngram"}),
        plain.model_name,
    )
    with serving(engine) as server:
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={
                "model": engine.model_name,
                "prompt": PROMPT,
                "max_tokens": 16,
                "temperature": 0,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text
        health = server.wait_idle()
        metrics = parse_prometheus(httpx.get(f"{server.url}/metrics", timeout=10).text)
    assert health["spec_proposed_tokens"] > 0
    assert metrics["zserve_spec_proposed_tokens"] == health["spec_proposed_tokens"]
    assert 0 < metrics["zserve_spec_accepted_tokens"] <= metrics["zserve_spec_proposed_tokens"]
    assert metrics["zserve_spec_acceptance_rate"] == health["spec_acceptance_rate"]
