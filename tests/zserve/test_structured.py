"""Structured output's parts without a model: the sampler's masks (greedy and sampled pick
only allowed tokens, the caller's logits are untouched), llguidance's matcher over
SmolLM2's real tokenizer (what it allows, when a value is complete), grammar errors that
name what is wrong, and the parsing of tool calls out of an `auto` answer."""

from __future__ import annotations

import json

import pytest
import torch

from tests.utils.models import smollm2_dir
from zserve.sampling import Sampler, SamplingParams
from zserve.server.tool_protocol import Tool
from zserve.server.tools import call_schema, forced_call_spec, parse_tool_calls
from zserve.structured import json_object, json_schema
from zserve.structured.backend import GrammarBackend

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["title", "year"],
    "additionalProperties": False,
}
TOOL = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string"}},
                "required": ["timezone"],
            },
        },
    }
)


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    from zserve.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir())
    return GrammarBackend(smollm2_dir() / "tokenizer.json", tok.eos_token_ids)


def test_masks_restrict_greedy_and_sampled_rows_and_leave_the_logits_alone() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 3
    before = logits.clone()
    allowed = torch.zeros(40, dtype=torch.bool)
    allowed[[5, 17, 31]] = True
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1)
    s = Sampler()
    gens = [None, torch.Generator().manual_seed(1), None]
    for _ in range(30):
        toks = s.sample(logits, [greedy, sampled, greedy], gens, [allowed, allowed, None])
        assert toks[0] == max([5, 17, 31], key=lambda t: logits[0, t].item())
        assert toks[1] in (5, 17, 31)
        assert toks[2] == int(logits[2].argmax())  # an unmasked row is plain greedy
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="allows no token"):
        s.sample(logits[:1], [greedy], [None], [torch.zeros(40, dtype=torch.bool)])


def test_the_matcher_follows_a_schema_over_smollm2s_tokens(backend: GrammarBackend) -> None:
    from zserve.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir())
    m = backend.matcher(json_schema(SCHEMA))
    width = backend.vocab_size
    first = m.allowed(width)
    # only text starting a JSON object; never EOS, never a special token
    starts = [tok.token_bytes(i) for i in first.nonzero().flatten().tolist()]
    assert starts and all(b.startswith(b"{") for b in starts), starts[:5]
    assert not first[tok.eos_token_ids].any()
    text = '{"title": "Hamlet", "year": 1603}'
    ids = tok.encode(text, add_special_tokens=False)
    for i, t in enumerate(ids):
        assert m.allowed(width)[t], (i, tok.decode([t]))
        assert not m.done
        m.consume(t)
    assert m.done  # the object is closed: the request ends here
    # a value the schema does not allow: "year" must be an integer
    bad = backend.matcher(json_schema(SCHEMA))
    for t in tok.encode('{"title": "Hamlet", "year": ', add_special_tokens=False):
        bad.consume(t)
    quote = tok.encode('"', add_special_tokens=False)[0]
    assert not bad.allowed(width)[quote]
    with pytest.raises(RuntimeError, match="broke the grammar"):
        bad.consume(quote)
    # wider logits (a padded embedding table) get the extra ids disallowed
    assert not backend.matcher(json_object()).allowed(width + 64)[width:].any()


def test_unusable_schemas_are_value_errors_naming_why() -> None:
    with pytest.raises(ValueError, match="not a usable JSON schema"):
        json_schema({"type": "frob"})
    with pytest.raises(ValueError, match="send a JSON object"):
        json_schema(["not", "a", "schema"])  # type: ignore[arg-type]


def test_forced_tool_calls_and_parsing_auto_answers(backend: GrammarBackend) -> None:
    from zserve.tokenizer import Tokenizer

    schema = call_schema(TOOL)
    assert schema["properties"]["name"] == {"const": "get_time"}
    spec = forced_call_spec([TOOL], "required")
    assert spec is not None and spec.kind == "tool_call"
    assert forced_call_spec([TOOL], "auto") is None
    # the forced grammar accepts a call and nothing else
    tok = Tokenizer(smollm2_dir())
    m = backend.matcher(spec)
    for t in tok.encode('{"name": "get_time", "arguments": {"timezone": "CET"}}', False):
        m.consume(t)
    assert m.done

    call = {"name": "get_time", "arguments": {"timezone": "UTC"}}
    for text in (
        json.dumps(call),
        f"<tool_call>\n{json.dumps(call)}\n</tool_call>",
        json.dumps({"name": "get_time", "parameters": {"timezone": "UTC"}}),  # Llama 3
    ):
        got = parse_tool_calls(text, [TOOL])
        assert got is not None and len(got) == 1, text
        assert got[0].function.name == "get_time"
        assert json.loads(got[0].function.arguments) == {"timezone": "UTC"}
    for text in ("It is noon.", json.dumps({"name": "other", "arguments": {}}), "{"):
        assert parse_tool_calls(text, [TOOL]) is None, text
