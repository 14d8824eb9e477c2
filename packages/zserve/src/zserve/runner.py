"""The model runner: one ragged forward of many sequences over the paged KV cache.

The scheduler hands :meth:`ModelRunner.forward` a list of :class:`SeqChunk` — prompt
chunks and 1-token decodes of different sequences — and gets back the logits of each
chunk's last token. The tokens are packed into one forward with no padding; each chunk's
keys/values are written to the cache at its positions ``start_pos ..`` (and nowhere else,
so blocks shared between sequences by prefix caching are never written), and each token
attends causally to its own sequence's keys through its block table.

The runner owns the KV tensors, not their bookkeeping: which blocks are free or shared
is the block manager's job; the runner only checks that a block table is long enough
and in range.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import znative.cuda
from zserve.kv_cache import DEFAULT_KV_CACHE_BYTES, KVCache
from zserve.model.attention import plan_ragged_attention, ragged_paged_attention
from zserve.model.checkpoint import SafetensorsCheckpoint, TensorCheckpoint
from zserve.model.config import LlamaConfig
from zserve.model.llama import AttentionFn, LlamaModel
from zserve.model.native import ragged_paged_attention_native
from zserve.offload import OffloadSpec
from zserve.tp.checkpoint import ShardedCheckpoint, cut_lm_head
from zserve.tp.plan import RankShard


@dataclass
class SeqChunk:
    """One sequence's slice of a ragged batch."""

    seq_id: int
    """The scheduler's id of the sequence (for error messages)."""
    token_ids: list[int]
    """Tokens to run now: a prompt chunk, or the 1 token being decoded."""
    start_pos: int
    """Position of ``token_ids[0]`` in its sequence (= tokens already in the KV cache)."""
    block_table: list[int]
    """Physical KV block ids covering positions ``[0, start_pos + len(token_ids))``."""
    want_logits: bool = True
    """False for a prompt chunk that is not the prompt's last."""
    all_logits: bool = False
    """Logits of every token of the chunk, not only the last (scoring a prompt)."""


class ModelRunner:
    """A LLaMA-family (or Mixtral) model and its paged KV cache; runs ragged batches.

    Args:
        model_dir: HF model directory (``config.json`` + ``*.safetensors``).
        num_blocks: KV blocks to allocate; None derives it from ``kv_cache_bytes``.
        block_size: tokens per KV block.
        dtype: weights, activations and KV cache dtype (logits are always fp32).
        device: where the model and the cache live.
        kv_cache_bytes: KV memory budget when ``num_blocks`` is None (default 1 GiB).
        max_model_len: longest sequence accepted (default: the model's
            ``max_position_embeddings``, or Mistral's ``sliding_window`` when smaller).
        weights: the weights by checkpoint name, already in memory (zchat's hybrid engine
            hands over what it gathered from ZeRO-3 partitions); None reads the
            safetensors of ``model_dir``, whose ``config.json`` is read either way.
        offload: a weight budget (:mod:`zserve.offload`): the decoder layers beyond it
            stream from host memory or disk each forward; None: every layer resident.
        tp: this process's shard of a tensor-parallel model (:mod:`zserve.tp`): it holds
            its heads, MLP columns and LM-head rows, caches its KV heads (as many blocks as
            the whole model would get), and :meth:`forward` returns its columns of the
            logits; None: the whole model.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        num_blocks: int | None = None,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        weights: dict[str, torch.Tensor] | None = None,
        offload: OffloadSpec | None = None,
        tp: RankShard | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = LlamaConfig.from_dir(self.model_dir)
        c = self.config
        limit = c.max_position_embeddings
        if c.sliding_window is not None:
            # Full attention equals windowed attention up to the window.
            limit = min(limit, int(c.sliding_window))
        if max_model_len is None:
            max_model_len = limit
        elif not 1 <= max_model_len <= limit:
            raise ValueError(
                f"max_model_len {max_model_len} must be in [1, {limit}] (the model's "
                "max_position_embeddings / sliding_window); lower it"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        self.device = torch.device(device)
        if offload is not None and self.device.type != "cpu":
            raise ValueError(
                f"weight offload streams layers into CPU memory; device {self.device} is not "
                "supported with weights_budget (serve on `cpu`, or drop the budget)"
            )
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        per_block = KVCache.bytes_per_block(
            num_layers=c.num_hidden_layers,
            block_size=block_size,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            dtype=dtype,
        )
        if num_blocks is None:
            budget = DEFAULT_KV_CACHE_BYTES if kv_cache_bytes is None else kv_cache_bytes
            num_blocks = budget // per_block
            if num_blocks < 1:
                raise ValueError(
                    f"kv_cache_bytes {budget} is less than one KV block ({per_block} bytes "
                    f"at block_size {block_size}); raise it"
                )
        elif num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        self.num_blocks = num_blocks
        checkpoint: SafetensorsCheckpoint | TensorCheckpoint | ShardedCheckpoint = (
            SafetensorsCheckpoint(self.model_dir)
            if weights is None
            else TensorCheckpoint(weights, self.model_dir)
        )
        if tp is not None:
            checkpoint = ShardedCheckpoint(checkpoint, tp, c)
        self.model = LlamaModel(
            c if tp is None else tp.config,
            checkpoint,  # type: ignore[arg-type]
            dtype=dtype,
            device=self.device,
            max_positions=max_model_len,
            offload=offload,
        )
        if tp is not None:
            cut_lm_head(self.model, tp)
        self.kv_cache = KVCache(
            num_layers=c.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.model.config.num_key_value_heads,
            head_dim=c.head_dim,
            dtype=dtype,
            device=self.device,
        )
        self.eos_token_ids: list[int] = _eos_token_ids(self.model_dir, c)
        self.attention: AttentionFn = ragged_paged_attention
        if self.model.native:  # CPU fp32/bf16: decodes on znative's paged-attention kernel
            self.attention = ragged_paged_attention_native
        if self.device.type == "cuda" and znative.cuda.cupy_status()[0]:
            # Decodes on the paged-attention kernel; prompt chunks stay on torch SDPA.
            from zserve.model.cuda_attention import ragged_paged_attention_cuda

            self.attention = ragged_paged_attention_cuda

    @property
    def vocab_size(self) -> int:
        """Columns of the logits."""
        return self.config.vocab_size

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes over all layers, keys and values."""
        return self.kv_cache.kv_bytes_per_block()

    @property
    def greedy_skips_logits(self) -> bool:
        """False: :meth:`forward_greedy` is :meth:`forward`'s logits' argmax, no cheaper."""
        return False

    def forward_greedy(self, chunks: Sequence[SeqChunk]) -> list[int]:
        """Each logits row's argmax of :meth:`forward` (the first of equal largest values)."""
        return [int(t) for t in self.forward(chunks).argmax(dim=-1).tolist()]

    def forward(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Runs all chunks' tokens packed into ONE forward (no padding).

        Writes their K/V into the cache at positions ``start_pos ..`` of each block table;
        each token attends causally to its own sequence's keys ``0 .. pos`` through the
        block table. Returns fp32 logits ``(n, vocab)``, in chunk order: of every token of a
        chunk with ``all_logits``, else of the LAST token of a chunk with ``want_logits``.

        Raises:
            ValueError: an empty chunk, a bad token id, a position past ``max_model_len``,
                a block table too short for ``start_pos + len(token_ids)``, or a block id
                out of ``[0, num_blocks)``.
        """
        if not chunks:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        tokens: list[int] = []
        logit_rows: list[int] = []
        for chunk in chunks:
            self._validate(chunk)
            if chunk.all_logits:
                logit_rows.extend(range(len(tokens), len(tokens) + len(chunk.token_ids)))
            elif chunk.want_logits:
                logit_rows.append(len(tokens) + len(chunk.token_ids) - 1)
            tokens.extend(chunk.token_ids)
        plan = plan_ragged_attention(
            [len(c.token_ids) for c in chunks],
            [c.start_pos for c in chunks],
            [c.block_table for c in chunks],
            self.block_size,
            self.device,
        )
        return self.model.forward(
            torch.tensor(tokens, dtype=torch.int64, device=self.device),
            plan,
            self.kv_cache,
            torch.tensor(logit_rows, dtype=torch.int64, device=self.device),
            attention=self.attention,
        )

    def _validate(self, chunk: SeqChunk) -> None:
        sid = chunk.seq_id
        n = len(chunk.token_ids)
        if n == 0:
            raise ValueError(f"sequence {sid}: empty chunk (token_ids is []); send >= 1 token")
        if chunk.start_pos < 0:
            raise ValueError(f"sequence {sid}: start_pos {chunk.start_pos} is negative")
        end = chunk.start_pos + n
        if end > self.max_model_len:
            raise ValueError(
                f"sequence {sid}: positions {chunk.start_pos}..{end - 1} reach past "
                f"max_model_len {self.max_model_len}; stop the sequence at {self.max_model_len} "
                "tokens"
            )
        needed = -(-end // self.block_size)
        if len(chunk.block_table) < needed:
            raise ValueError(
                f"sequence {sid}: block table has {len(chunk.block_table)} block(s) but "
                f"start_pos {chunk.start_pos} + {n} token(s) = {end} positions need {needed} "
                f"at block_size {self.block_size}; allocate blocks before the forward"
            )
        for b in chunk.block_table[:needed]:
            if not 0 <= b < self.num_blocks:
                raise ValueError(
                    f"sequence {sid}: block id {b} is out of range [0, {self.num_blocks})"
                )
        vocab = self.vocab_size
        if min(chunk.token_ids) < 0 or max(chunk.token_ids) >= vocab:
            bad = next(t for t in chunk.token_ids if not 0 <= t < vocab)
            raise ValueError(f"sequence {sid}: token id {bad} is out of range [0, {vocab})")


def _eos_token_ids(model_dir: Path, config: LlamaConfig) -> list[int]:
    """End-of-sequence ids from config.json and generation_config.json, in that order."""
    ids = list(config.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        for t in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if int(t) not in ids:
                ids.append(int(t))
    return ids
