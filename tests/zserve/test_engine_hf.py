"""Greedy outputs of the engine on real SmolLM2 weights are token-for-token those of
transformers `generate(do_sample=False)`: both policies, with and without prefix
caching, with preemption forced by a tiny KV cache, and with a prompt longer than
the token budget (so split across forwards)."""

from __future__ import annotations

import pytest
import torch

from tests.utils.models import smollm2_dir
from zserve.engine import Engine
from zserve.sampling import SamplingParams
from zserve.tokenizer import Tokenizer

# About 60 s in all on a quiet 2-core machine: the xdist workers start this file first.
pytestmark = pytest.mark.heavy(60)

MAX_TOKENS = 10
TOKEN_BUDGET = 48


def _excerpt(plays: dict[str, str], title: str, start: str, chars: int) -> str:
    text = plays[title]
    i = text.index(start)
    return text[i : i + chars]


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    from ztrain.data import load_plays

    plays = dict(load_plays())
    tok = Tokenizer(smollm2_dir())
    hamlet = _excerpt(plays, "Hamlet", "To be, or not to be", 450)  # ~110 tokens
    questions = [
        "Who is speaking here?",
        "What is the mood of this passage?",
        "Summarize it in one sentence.",
    ]
    chat = [
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        tok.apply_chat_template([{"role": "user", "content": "Name three colors."}]),
    ]
    shared = [
        tok.apply_chat_template([{"role": "user", "content": f"{hamlet}\n\n{q}"}])
        for q in questions
    ]  # a long common prefix, different endings
    lines = [
        _excerpt(plays, "Macbeth", "To-morrow, and to-morrow", 120),
        _excerpt(plays, "Richard III", "Now is the winter", 60),
        "Friends, Romans",
        hamlet,  # longer than the token budget: split across forwards
    ]
    out = lines + chat + shared
    assert max(len(tok.encode(p)) for p in out) > 2 * TOKEN_BUDGET
    return out


@pytest.fixture(scope="module")
def reference(prompts: list[str]) -> list[list[int]]:
    """transformers greedy `generate`, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    tok = Tokenizer(smollm2_dir())
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([tok.encode(p)])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
            )
            new = gen[0, ids.shape[1] :].tolist()
            out.append(new)  # generate stops after EOS (kept), as the engine does
    return out


def _run(engine: Engine, prompts: list[str], late: int = 2) -> list[list[int]]:
    """Add all but the `late` last prompts, step once, add those (later arrivals find
    the first's blocks in the prefix cache), run to the end."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    for i, p in enumerate(prompts[:-late]):
        engine.add_request(str(i), p, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for step in range(10_000):
        if step == 1:
            for i in range(len(prompts) - late, len(prompts)):
                engine.add_request(str(i), prompts[i], params)
        elif not engine.has_unfinished():
            break
        for o in engine.step():
            got[o.request_id] += o.token_ids
    return [got[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "policy, prefix_caching, num_blocks, block_size",
    [
        ("splitfuse", True, 256, 16),
        ("splitfuse", False, 256, 16),
        ("prefill-first", True, 256, 16),
        ("prefill-first", False, 256, 16),
        # Tiny caches: 48 x 4 slots, the longest request needs ~40 blocks; decodes cross a
        # block boundary every 4 tokens, so running out (and preempting) is certain.
        ("splitfuse", True, 48, 4),
        ("prefill-first", False, 48, 4),
    ],
)
def test_greedy_matches_transformers(
    policy, prefix_caching, num_blocks, block_size, prompts, reference
) -> None:
    engine = Engine(
        smollm2_dir(),
        policy=policy,
        prefix_caching=prefix_caching,
        num_blocks=num_blocks,
        block_size=block_size,
        token_budget=TOKEN_BUDGET,
        max_num_seqs=8,
    )
    start = engine.stats()["free_blocks"]
    got = _run(engine, prompts)
    for i, (g, r) in enumerate(zip(got, reference, strict=True)):
        assert g == r, f"prompt {i} ({prompts[i][:40]!r}...): engine {g} != transformers {r}"
    s = engine.stats()
    assert s["free_blocks"] == start == num_blocks
    if num_blocks == 48:
        assert s["num_preempted"] > 0, s
    if prefix_caching and num_blocks == 256:
        # The three questions about the same passage share its >= 8 full blocks.
        assert s["prefix_hits"] >= 2 * 8 * 16, s
