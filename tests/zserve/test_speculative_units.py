"""The pieces of speculative decoding on their own: n-gram lookup against a brute-force
reference, greedy acceptance, the block manager's rollback, config validation."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from tests.zserve.fakes import make_seq
from zserve.block_manager import BlockManager
from zserve.config import EngineConfig
from zserve.speculative import NgramDrafter, accept_greedy, accept_sampled, ngram_propose


def _reference_ngram(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Plain loops: largest n with an earlier match; latest match with k followers, else
    the earliest match."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            full = [i for i in starts if i + n + k <= len(tokens)]
            i = full[-1] if full else starts[0]
            return tokens[i + n : i + n + k]
    return []


def test_ngram_matches_the_reference_on_random_sequences() -> None:
    rng = random.Random(0)
    hits = 0
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        k, max_n = rng.randint(1, 5), rng.randint(1, 4)
        min_n = rng.randint(1, max_n)
        got = ngram_propose(tokens, k, max_n, min_n)
        assert got == _reference_ngram(tokens, k, max_n, min_n), (tokens, k, max_n, min_n)
        hits += bool(got)
    assert hits > 100


def test_ngram_examples() -> None:
    assert ngram_propose([1, 2, 3, 4, 1, 2], 2, 3, 1) == [3, 4]
    assert ngram_propose([7, 1, 2, 9, 8, 1, 2], 3, 2, 2) == [9, 8, 1]
    assert ngram_propose([1, 2, 3], 2, 3, 1) == []  # nothing repeats
    assert ngram_propose([5, 5, 5, 5], 2, 2, 1) == [5, 5]
    assert ngram_propose([1, 2, 3, 1], 4, 1, 1) == [2, 3, 1]  # only 3 follow the match


def test_ngram_drafter_caches_per_length_and_validates() -> None:
    d = NgramDrafter(3, 1)
    seq = make_seq(0)
    seq.prompt_token_ids[:] = [1, 2, 3, 1, 2]
    assert d.max_draft(seq, 2) == 2
    seq.output_token_ids.append(9)
    assert d.max_draft(seq, 2) == 0  # a new length: looked up again
    with pytest.raises(ValueError, match="prompt_lookup_min 3 and prompt_lookup_max 2"):
        NgramDrafter(2, 3)


def test_accept_greedy() -> None:
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept_greedy([1, 2, 3], [1, 5, 3, 4]) == [1, 5]
    assert accept_greedy([1], [2, 9]) == [2]
    with pytest.raises(ValueError, match="need d \\+ 1"):
        accept_greedy([1, 2], [1, 2])


def test_sampled_acceptance_emits_the_target_distribution() -> None:
    """Monte Carlo over 20000 draws, 6 tokens, 2 drafts: the first emitted token follows
    row 0's distribution; given the first draft was emitted, the second follows row 1;
    given both, the bonus follows row 2. A draft token with probability 0 (outside
    top-k) is never emitted in its place. Tolerance: 5 standard errors of each frequency."""
    probs = torch.tensor(
        [
            [0.10, 0.45, 0.05, 0.25, 0.15, 0.00],  # draft 1 (p 0.45)
            [0.30, 0.00, 0.20, 0.10, 0.00, 0.40],  # draft 4 (p 0: never kept)
            [0.05, 0.15, 0.50, 0.10, 0.10, 0.10],
        ]
    )
    gen = torch.Generator().manual_seed(0)
    n = 20000
    runs = [accept_sampled([1, 4], probs, gen) for _ in range(n)]
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=6) / n
    assert torch.allclose(first, probs[0], atol=5 * (0.25 / n) ** 0.5)
    after_1 = [r for r in runs if r[0] == 1]
    assert all(len(r) == 2 and r[1] != 4 for r in after_1)  # draft 4 (p 0) always rejected
    assert all(len(r) == 1 for r in runs if r[0] != 1)  # a rejection ends the step
    second = torch.bincount(torch.tensor([r[1] for r in after_1]), minlength=6) / len(after_1)
    assert torch.allclose(second, probs[1], atol=5 * (0.25 / len(after_1)) ** 0.5)
    certain = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert accept_sampled([1, 2], certain, gen) == [1, 2, 0]  # p 1: always accepted
    bonus = [accept_sampled([0], probs[[1, 2]], gen) for _ in range(n)]
    kept = torch.bincount(torch.tensor([r[-1] for r in bonus if len(r) == 2]), minlength=6)
    assert torch.allclose(kept / kept.sum(), probs[2], atol=5 * (0.25 / int(kept.sum())) ** 0.5)
    with pytest.raises(ValueError, match="need d \\+ 1"):
        accept_sampled([1, 2], probs[:2], gen)


def test_truncate_releases_the_tail_and_keeps_published_blocks() -> None:
    kv = BlockManager(8, 4)
    kv.allocate(0, 10)  # 3 blocks
    tokens = list(range(10))
    kv.cache_full_blocks(0, tokens, 5)  # block 0 published
    kv.truncate(0, 5)
    assert len(kv.block_table(0)) == 2 and kv.num_free_blocks == 6
    with pytest.raises(ValueError, match="already in the prefix cache"):
        kv.truncate(0, 0)
    kv.truncate(1, 0)  # unknown id: no-op
    kv.free(0)
    assert kv.num_free_blocks == 8


def test_config_accepts_vllm_speculative_config_and_names_bad_keys() -> None:
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert (c.speculative, c.num_speculative_tokens) == ("ngram", 3)
    for bad, msg in [
        (dict(speculative="ngram", policy="prefill-first"), "needs policy 'splitfuse'"),
        (dict(prompt_lookup_min=5, prompt_lookup_max=4), "prompt_lookup_min 5 > "),
        (dict(draft_layers=3), "draft_layers 3 is for speculative 'self-draft'"),
        (dict(speculative_config={"model": "tiny"}), "separate draft checkpoint"),
        (dict(speculative_config={"method": "ngram", "eta": 1}), "keys \\['eta'\\]"),
        (dict(speculative="eagle"), "speculative"),
    ]:
        with pytest.raises(ValidationError, match=msg):
            EngineConfig(**bad)
