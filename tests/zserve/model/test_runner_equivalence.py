"""ModelRunner against transformers on the real SmolLM2-135M-Instruct weights.

Every ragged layout of the same tokens — the whole prompt in one forward, uneven chunks
over several forwards through a shuffled, non-contiguous block table, a batch mixing a
prompt chunk with other sequences' decodes — must give transformers' logits, and greedy
decoding through the runner must reproduce ``generate(do_sample=False)`` token for token.

Tolerance: fp32 on CPU, max |logit difference| <= 1e-3 (measured ~2e-5 to 1e-4: the
runner fuses q/k/v and gate/up into single GEMMs and reads keys back from the cache, so
summation order differs from transformers' in the last bits).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.utils.models import smollm2_dir
from tests.zserve.tiny_llama import hf_greedy
from zserve.runner import ModelRunner, SeqChunk
from ztrain.data import clean_markdown, plays_dir

ATOL = 1e-3
BLOCK = 16
NUM_BLOCKS = 96


def _shakespeare(play: str, opening: str, chars: int) -> str:
    path = next(p for p in plays_dir().glob("*/*.md") if p.stem == play)
    _, text = clean_markdown(path.read_text(encoding="utf-8"), path.stem)
    start = text.index(opening)
    return text[start : start + chars]


@pytest.fixture(scope="module")
def tokenizer() -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.fixture(scope="module")
def prompts(tokenizer: AutoTokenizer) -> list[list[int]]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who wrote Hamlet, and when was it first performed?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    texts = [
        _shakespeare("hamlet", "To be, or not to be", 300),
        _shakespeare("macbeth", "To-morrow, and to-morrow", 150),
        chat,
        _shakespeare("the-tempest", "Our revels now are ended", 120),
    ]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


@pytest.fixture(scope="module")
def hf_model() -> AutoModelForCausalLM:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(smollm2_dir(), num_blocks=NUM_BLOCKS, block_size=BLOCK)


@pytest.fixture(scope="module")
def ref(hf_model: AutoModelForCausalLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' fp32 logits at every position of every prompt, (len(ids), vocab) each."""
    with torch.no_grad():
        return [hf_model(torch.tensor([ids])).logits[0].float() for ids in prompts]


class Blocks:
    """Hands out distinct block ids in a shuffled order (a scattered, non-contiguous table)."""

    def __init__(self, seed: int) -> None:
        self._free: Iterator[int] = iter(random.Random(seed).sample(range(NUM_BLOCKS), NUM_BLOCKS))

    def table(self, num_tokens: int) -> list[int]:
        return [next(self._free) for _ in range(-(-num_tokens // BLOCK))]


def test_config_reads_smollm2(runner: ModelRunner) -> None:
    c = runner.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (576, 30, 9)
    assert (c.num_key_value_heads, c.head_dim, c.vocab_size) == (3, 64, 49152)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings
    assert runner.max_model_len == 8192 and runner.eos_token_ids == [2]
    assert runner.kv_bytes_per_block() == 2 * 30 * BLOCK * 3 * 64 * 4


def test_full_prompt_forward_matches_transformers(
    runner: ModelRunner, ref: list[torch.Tensor], prompts: list[list[int]]
) -> None:
    blocks = Blocks(seed=1)
    chunks = [SeqChunk(i, ids, 0, blocks.table(len(ids))) for i, ids in enumerate(prompts)]
    single = runner.forward(chunks[:1])
    assert single.shape == (1, 49152) and single.dtype == torch.float32
    diff = (single[0] - ref[0][-1]).abs().max().item()
    assert diff <= ATOL, f"prompt 0 alone: max |logit diff| {diff:.2e}"
    packed = runner.forward(chunks)  # all prompts packed in one forward
    assert packed.shape == (len(prompts), 49152)
    for i, r in enumerate(ref):
        diff = (packed[i] - r[-1]).abs().max().item()
        assert diff <= ATOL, f"prompt {i} packed: max |logit diff| {diff:.2e}"
        assert packed[i].argmax() == r[-1].argmax()


@pytest.mark.parametrize("cuts", [(1, 17, 40), (16, 32, 33, 50)])
def test_chunked_prefill_through_shuffled_blocks_matches_transformers(
    runner: ModelRunner, ref: list[torch.Tensor], prompts: list[list[int]], cuts: tuple[int, ...]
) -> None:
    ids = prompts[0]
    table = Blocks(seed=sum(cuts)).table(len(ids))
    assert table != sorted(table) and len(ids) > cuts[-1]
    bounds = [0, *cuts, len(ids)]
    for lo, hi in itertools.pairwise(bounds):
        out = runner.forward([SeqChunk(7, ids[lo:hi], lo, table)])
        # Every chunk's last-token logits match transformers at that position.
        diff = (out[0] - ref[0][hi - 1]).abs().max().item()
        assert diff <= ATOL, f"chunk [{lo}, {hi}): max |logit diff| {diff:.2e}"
    skipped = runner.forward([SeqChunk(8, ids[:20], 0, table, want_logits=False)])
    assert skipped.shape == (0, 49152)


def test_ragged_batch_of_prefill_chunk_and_decodes_matches_transformers(
    runner: ModelRunner, ref: list[torch.Tensor], prompts: list[list[int]]
) -> None:
    a, b, c = prompts[0], prompts[1], prompts[2]
    blocks = Blocks(seed=3)
    ta, tb, tc = blocks.table(len(a)), blocks.table(len(b)), blocks.table(len(c))
    # b and c are prefilled but for their last token; a has its first 37 tokens cached.
    runner.forward(
        [
            SeqChunk(1, b[:-1], 0, tb, want_logits=False),
            SeqChunk(2, c[:-1], 0, tc, want_logits=False),
            SeqChunk(0, a[:37], 0, ta, want_logits=False),
        ]
    )
    out = runner.forward(
        [
            SeqChunk(1, b[-1:], len(b) - 1, tb),  # a decode
            SeqChunk(0, a[37:], 37, ta),  # a prompt chunk after cached tokens
            SeqChunk(2, c[-1:], len(c) - 1, tc),  # another decode
        ]
    )
    for i, r in enumerate((ref[1][-1], ref[0][-1], ref[2][-1])):
        diff = (out[i] - r).abs().max().item()
        assert diff <= ATOL, f"chunk {i} of the ragged batch: max |logit diff| {diff:.2e}"


def test_greedy_decode_matches_generate(
    runner: ModelRunner, hf_model: AutoModelForCausalLM, prompts: list[list[int]]
) -> None:
    """Two sequences decode together, 1 token each per forward, for 20 tokens."""
    steps = 20
    seqs = [prompts[2], prompts[3]]
    blocks = Blocks(seed=4)
    tables = [blocks.table(len(s) + steps) for s in seqs]
    logits = runner.forward([SeqChunk(i, s, 0, tables[i]) for i, s in enumerate(seqs)])
    generated: list[list[int]] = [[], []]
    for _ in range(steps):
        for g, t in zip(generated, logits.argmax(-1).tolist(), strict=True):
            g.append(t)
        chunks = [
            SeqChunk(i, [g[-1]], len(s) + len(g) - 1, tables[i])
            for i, (s, g) in enumerate(zip(seqs, generated, strict=True))
        ]
        logits = runner.forward(chunks)
    for s, g in zip(seqs, generated, strict=True):
        expected = hf_greedy(hf_model, s, steps)
        # generate stops after EOS; the runner's tokens must agree up to and including it.
        assert len(expected) >= 5 and g[: len(expected)] == expected
