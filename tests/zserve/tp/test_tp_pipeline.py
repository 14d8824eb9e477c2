"""`zserve.pipeline(..., tp=N)` on the real SmolLM2-135M-Instruct (9 query / 3 KV heads) against
the single-process pipeline: the logits of whole prompts, and greedy outputs token for token.

tp=2 cuts the heads unevenly (query 4/5 over KV heads 0-1 and 1-2), tp=3 gives each rank one KV head, tp=4
replicates a KV head on two ranks (query heads 1/2 of its group).

Tolerance: fp32, max |logit difference| <= 1e-3 (the single-process runner's own tolerance
against transformers; tensor parallelism only reorders the o and down projections' sums).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import zserve
from tests.utils.models import smollm2_dir
from tests.utils.tiny_lm import write_tiny_lm
from tests.zserve.server.conftest import shakespeare_prompts
from zserve.runner import ModelRunner, SeqChunk

ATOL = 1e-3
OPTIONS = dict(max_model_len=256, num_blocks=64)


def _prompt_logits(runner: object, prompts: list[list[int]]) -> torch.Tensor:
    chunks, block = [], 0
    for i, ids in enumerate(prompts):
        n = -(-len(ids) // 16)
        chunks.append(SeqChunk(i, ids, 0, list(range(block, block + n)), all_logits=True))
        block += n
    return runner.forward(chunks)  # type: ignore[attr-defined]


def tp_against_one_process(
    model: Path,
    tp: int,
    texts: list[str],
    max_tokens: int,
    options: dict[str, Any],
    inspect: Callable[[Any], None] | None = None,
) -> float:
    """``model`` served by one process and at ``tp`` ranks: asserts the greedy outputs of
    ``texts`` equal, and returns the largest |difference| of their prompt logits (``inspect``
    sees the tp pipeline while it runs)."""
    with zserve.pipeline(model, **options) as one:
        ids = [one.engine.tokenizer.encode(t) for t in texts]
        want = one(texts, max_tokens=max_tokens, temperature=0)
        whole = _prompt_logits(one.engine.runner, ids)
        assert isinstance(one.engine.runner, ModelRunner)
    with zserve.pipeline(model, tp=tp, **options) as many:
        got = many(texts, max_tokens=max_tokens, temperature=0)
        cut = _prompt_logits(many.engine.runner, ids)
        if inspect is not None:
            inspect(many)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert cut.shape == whole.shape
    return float((cut - whole).abs().max().item())


@pytest.mark.slow(reason="SmolLM2 twice, ~40 s at tp=2; the tiny model below is the fast check")
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_tp_logits_and_greedy_equal_one_process(tp: int) -> None:
    texts = shakespeare_prompts(4, start=11)
    diff = tp_against_one_process(smollm2_dir(), tp, texts, 16, OPTIONS)
    assert diff <= ATOL, f"tp={tp}: max |logit diff| {diff}"


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_tiny_pipeline_tp2_greedy_equals_tp1(tmp_path: Path, speculative: str | None) -> None:
    """The fast check of the same: the tiny random LLaMA with SmolLM2's tokenizer (and with
    n-gram drafts verified in the tensor-parallel forward)."""
    model = write_tiny_lm(tmp_path / "lm")
    texts = shakespeare_prompts(3, start=5)
    with zserve.pipeline(model, max_model_len=128, num_blocks=32) as one:
        want = one(texts, max_tokens=8, temperature=0)
    options = dict(max_model_len=128, num_blocks=32, speculative=speculative)
    with zserve.pipeline(model, tp=2, **options) as two:
        got = two(texts, max_tokens=8, temperature=0)
        assert two.engine.runner.local.kv_cache.num_kv_heads == 1  # 2 KV heads over 2 ranks
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_tiny_tp2_with_empty_query_slots_equals_tp1(tmp_path: Path) -> None:
    """6 query / 3 KV heads at tp=2: query heads 0-2 and 3-5, each rank holding two KV heads
    (KV head 1 on both) and attending with one empty query slot (rank 0 after its heads,
    rank 1 before): prompt logits through the per-op path, greedy decodes through the decode
    program, against one process."""
    model = write_tiny_lm(tmp_path / "lm", heads=6, kv_heads=3)

    def rank_0(two: Any) -> None:
        local = two.engine.runner.local
        assert local.model.config.attention_pad == (0, 1)
        assert local.kv_cache.num_kv_heads == 2

    options = dict(max_model_len=128, num_blocks=32)
    diff = tp_against_one_process(model, 2, shakespeare_prompts(3, start=7), 8, options, rank_0)
    assert diff <= ATOL, f"max |logit diff| {diff}"
