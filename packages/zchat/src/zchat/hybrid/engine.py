"""The hybrid engine: one rollout = gather the ZeRO-3 actor into zserve's runner, generate with
SplitFuse batching, release.

DeepSpeed-Chat's Hybrid Engine switches the actor between ZeRO-3 training and an inference
mode with fused kernels and a KV cache, because generation is where RLHF spends its time.
Here the inference side is zserve: the actor's partitions are gathered once per rollout
(:func:`~zchat.hybrid.gather.gather_full_weights`), handed to a
:class:`~zserve.runner.ModelRunner` as its weights (no second model object; see there),
a paged KV cache sized for the rollout is allocated, zserve's engine runs every prompt with
the Dynamic SplitFuse scheduler (decodes and prompt chunks packed into one forward of at most
``token_budget`` tokens), and then everything is dropped: the actor is back to its partitions.
Each phase's wall time and memory is recorded in :class:`RolloutStats`.

Collective under ZeRO-3: every rank calls :meth:`HybridEngine.generate` (with its own
prompts, as many as it likes) because the gather is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zchat.hybrid.gather import gather_full_weights, resident_param_bytes, tensor_bytes
from zcore.process import rss_bytes
from zserve.config import EngineConfig
from zserve.engine import Engine
from zserve.runner import ModelRunner
from zserve.sampling import MIN_TEMPERATURE, SamplingParams
from zserve.tokenizer import Tokenizer


@dataclass
class Generation:
    """One prompt's rollout."""

    prompt_ids: list[int]
    token_ids: list[int]
    """The generated tokens (an EOS that ended it included)."""
    logprobs: list[float]
    """Each generated token's log-probability under the actor (raw logits, before
    temperature/top-k/top-p), one per ``token_ids``."""
    finish_reason: str | None


@dataclass
class RolloutStats:
    """Time (s) and memory (bytes) of one rollout's phases, on this rank."""

    gather_s: float = 0.0
    """All-gathering the partitions and building the runner (fused matrices, KV cache)."""
    generate_s: float = 0.0
    release_s: float = 0.0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    forward_steps: int = 0
    actor_bytes_before: int = 0
    """The actor's own weight memory before the rollout (its ZeRO-3 level: shards and
    persistent parameters)."""
    weights_bytes: int = 0
    """The full weights zserve served (gathered tensors and fused matrices)."""
    kv_cache_bytes: int = 0
    actor_bytes_after: int = 0
    """The actor's weight memory after the release (equal to ``actor_bytes_before``)."""
    rss: dict[str, int] = field(default_factory=dict)
    """This process's resident set size at the start and after each phase."""

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the generate phase."""
        return self.generated_tokens / self.generate_s if self.generate_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tokens_per_s": self.tokens_per_s}


def model_dir_of(model: nn.Module) -> Path:
    """The HF directory the actor was loaded from (its ``config.name_or_path``)."""
    path = Path(str(getattr(getattr(model, "config", None), "name_or_path", "") or ""))
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"the actor's config.name_or_path `{path}` has no config.json + tokenizer.json; "
            "load it with `zcore.hf.from_pretrained(cls, dir)` or pass `model_dir=`"
        )
    return path


class HybridEngine:
    """Rollouts of a (ZeRO-3) HF LLaMA-family actor on zserve's paged-KV runner.

    Args:
        actor: a ``ZEngine`` or the HF model itself (``LlamaForCausalLM``).
        model_dir: the directory whose ``config.json`` and tokenizer describe the actor
            (default: where ``zcore.hf.from_pretrained`` loaded it from).
        token_budget: tokens per SplitFuse forward (decodes first, then prompt chunks).
        block_size: tokens per KV block.
        max_num_seqs: most sequences decoding at once (default: every prompt).
    """

    def __init__(
        self,
        actor: Any,
        model_dir: str | os.PathLike[str] | None = None,
        *,
        token_budget: int = 512,
        block_size: int = 16,
        max_num_seqs: int | None = None,
    ) -> None:
        self.model: nn.Module = getattr(actor, "module", actor)
        self.model_dir = Path(model_dir) if model_dir is not None else model_dir_of(self.model)
        self.tokenizer = Tokenizer(self.model_dir)
        self.token_budget = token_budget
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.last_stats: RolloutStats | None = None

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> tuple[list[Generation], RolloutStats]:
        """Generate for every prompt (token ids) with ``params``; a sampled request without
        a seed of its own gets ``params.seed + i`` (or ``i``) so a rollout is reproducible.
        Returns the generations in prompt order and the phases' stats."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError(
                f"prompts must be non-empty token-id lists; got {len(prompts)} prompt(s), "
                f"{sum(len(p) == 0 for p in prompts)} empty"
            )
        stats = RolloutStats(actor_bytes_before=resident_param_bytes(self.model))
        stats.rss["start"] = rss_bytes()
        t0 = time.perf_counter()
        weights = gather_full_weights(self.model)
        longest = max(len(p) for p in prompts) + params.max_tokens
        blocks = sum(-(-(len(p) + params.max_tokens) // self.block_size) for p in prompts)
        dtype = next(iter(weights.values())).dtype
        config = EngineConfig(
            policy="splitfuse",
            token_budget=self.token_budget,
            max_num_seqs=min(4096, self.max_num_seqs or len(prompts)),
            block_size=self.block_size,
            num_blocks=blocks + 1,
            max_model_len=max(2, longest),
            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype, "float16"),
            device=str(next(iter(weights.values())).device),
        )
        runner = ModelRunner(
            self.model_dir,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            dtype=config.torch_dtype,
            device=config.device,
            max_model_len=config.max_model_len,
            weights=weights,
        )
        del weights  # the runner holds what it serves; fused pieces die here
        served = [t for t in vars(runner.model).values() if isinstance(t, torch.Tensor)]
        for layer in runner.model.layers:
            served += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
            served += [t for t in vars(layer.mlp).values() if isinstance(t, torch.Tensor)]
        stats.weights_bytes = tensor_bytes(served)
        stats.kv_cache_bytes = runner.num_blocks * runner.kv_bytes_per_block()
        stats.gather_s = time.perf_counter() - t0
        stats.rss["gathered"] = rss_bytes()
        del served
        t1 = time.perf_counter()
        try:
            engine = Engine.from_parts(runner, self.tokenizer, config)
            gens = self._run(engine, prompts, params)
            stats.forward_steps = engine.num_steps
        finally:
            stats.generate_s = time.perf_counter() - t1
            stats.rss["generated"] = rss_bytes()
            t2 = time.perf_counter()
            engine = None  # the runner's last owners: its weights and KV cache go with it
            del runner
            stats.release_s = time.perf_counter() - t2
        stats.rss["released"] = rss_bytes()
        stats.actor_bytes_after = resident_param_bytes(self.model)
        stats.generated_tokens = sum(len(g.token_ids) for g in gens)
        stats.prompt_tokens = sum(len(p) for p in prompts)
        self.last_stats = stats
        return gens, stats

    def _run(
        self, engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        base = params.seed if params.seed is not None else 0
        greedy = params.temperature < MIN_TEMPERATURE or params.top_k == 1
        for i, prompt in enumerate(prompts):
            lp = 0 if params.logprobs is None else params.logprobs
            seed = params.seed if greedy else base + i
            engine.add_request(str(i), list(prompt), replace(params, logprobs=lp, seed=seed))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        lps: dict[str, list[float]] = {k: [] for k in tokens}
        reasons: dict[str, str | None] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.error is not None:
                    raise RuntimeError(f"rollout request {out.request_id} failed: {out.error}")
                tokens[out.request_id] += out.token_ids
                lps[out.request_id] += [lp.logprob for lp in out.logprobs or []]
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        return [
            Generation(list(p), tokens[str(i)], lps[str(i)], reasons.get(str(i)))
            for i, p in enumerate(prompts)
        ]
