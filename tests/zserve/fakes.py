"""Model-free stand-ins for the runner and tokenizer, and request factories
(in the spirit of vLLM's tests/v1/core/utils.py).

`FakeRunner` behaves like a paged-KV model in the one way the scheduler and the
block manager can break: the "key/value" it writes at position p is a hash of the
sequence's tokens 0..p, computed from the entry at p-1 *read back through the block
table*. The next-token logits depend on that hash, so any wrong block (a bad prefix
hit, a block reused while still shared, a stale block after preemption) changes the
generated tokens versus `reference_generate`, which runs the same hash chain on
plain lists. It also asserts that every slot it writes is in a block held by
exactly one sequence (shared blocks must never be written).
"""

from __future__ import annotations

import hashlib

import torch

from zserve.block_manager import BlockManager
from zserve.config import EngineConfig
from zserve.engine import Engine
from zserve.sampling import SamplingParams
from zserve.scheduler import Sequence

VOCAB = 101


def _h(prev: bytes, tok: int) -> bytes:
    return hashlib.blake2b(prev + tok.to_bytes(4, "little"), digest_size=8).digest()


def _logits(h: bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(h, "little") & ((1 << 62) - 1))
    return torch.randn(VOCAB, generator=g) * 3


class FakeRunner:
    greedy_skips_logits = False
    """The engine always takes the logits (``Runner.greedy_skips_logits``)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int = 512):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids: list[int] = []
        self.slots: dict[tuple[int, int], bytes] = {}
        self.kv: BlockManager | None = None  # set by make_engine, for the sharing check
        self.forward_sizes: list[int] = []

    def forward(self, chunks) -> torch.Tensor:
        rows = []
        bs = self.block_size
        self.forward_sizes.append(sum(len(c.token_ids) for c in chunks))
        for c in chunks:
            end = c.start_pos + len(c.token_ids)
            assert len(c.block_table) * bs >= end, (c.block_table, end)
            h = b"root"
            if c.start_pos:
                p = c.start_pos - 1
                h = self.slots[(c.block_table[p // bs], p % bs)]
            for i, tok in enumerate(c.token_ids):
                p = c.start_pos + i
                block = c.block_table[p // bs]
                if self.kv is not None:
                    assert self.kv.ref_count(block) == 1, f"write into shared block {block}"
                h = _h(h, tok)
                self.slots[(block, p % bs)] = h
                if getattr(c, "all_logits", False):  # a verified draft needs every row
                    rows.append(_logits(h))
            if c.want_logits and not getattr(c, "all_logits", False):
                rows.append(_logits(h))
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


class FakeTokenizer:
    """One letter per token: id t <-> chr(ord('a') + t % 26); eos configurable."""

    vocab_size = VOCAB

    def __init__(self, eos: tuple[int, ...] = ()):
        self.eos_token_ids = list(eos)

    def encode(self, text: str) -> list[int]:
        return [ord(ch) - ord("a") for ch in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids if t not in self.eos_token_ids)


def reference_generate(prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy generation with the fake model on plain lists: no cache, no paging."""
    h = b"root"
    for tok in prompt:
        h = _h(h, tok)
    out: list[int] = []
    for _ in range(max_tokens):
        tok = int(_logits(h).argmax())
        out.append(tok)
        h = _h(h, tok)
    return out


def make_engine(
    num_blocks: int = 64, block_size: int = 4, eos: tuple[int, ...] = (), **config
) -> Engine:
    runner = FakeRunner(num_blocks, block_size)
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, **config)
    engine = Engine.from_parts(runner, FakeTokenizer(eos), cfg, "fake")
    runner.kv = engine.kv
    return engine


def run_to_completion(engine: Engine, max_steps: int = 100_000) -> dict[str, list]:
    """request_id -> [token ids, text, finish_reason]; fails if the engine stalls."""
    res: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return res
        for o in engine.step():
            r = res.setdefault(o.request_id, [[], "", None])
            r[0] += o.token_ids
            r[1] += o.text
            if o.finished:
                r[2] = o.finish_reason
    raise AssertionError(f"engine did not finish in {max_steps} steps: {engine.stats()}")


_next_id = iter(range(1 << 30))


def make_seq(prompt_len: int, max_tokens: int = 4, first: int | None = None) -> Sequence:
    """A scheduler Sequence with prompt tokens first, first+1, ... (mod VOCAB); by
    default each sequence starts elsewhere, so prompts share no prefix."""
    sid = next(_next_id)
    first = sid * 37 if first is None else first
    prompt = [(first + i) % VOCAB for i in range(prompt_len)]
    return Sequence(sid, f"r{sid}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
