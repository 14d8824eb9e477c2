"""What PPO and GRPO share: a rank's rollouts on the hybrid engine, the held-out answers,
and the loop of evaluate, steps, evaluate.

:class:`Rollouts` owns the actor's :class:`~zchat.hybrid.HybridEngine`. Step ``s`` of rank
``r`` takes the ``prompts_per_rank`` training prompts from position ``(s * world + r) * n``
of the pool (wrapping), and samples them at ``temperature`` with the seed
``seed * 1_000_003 + (s * world + r) * len(requests)``, so a run is reproducible and no two
ranks or steps share a seed. The held-out prompts are split over ranks (``r::world``) and
answered greedily and, with ``heldout_samples`` k, k times each with fixed seeds
(:mod:`zchat.heldout`); a stage scores the answers its own way.

:func:`rollout_loop` runs a stage's ``evaluate`` before the first step and after the last
(and every ``eval_every`` steps), writes each step's record and the evaluations to the
stage's ``metrics.jsonl`` (:class:`zchat.train_loop.Recorder`) with a live progress line,
and :func:`save_actor` writes the trained actor (LoRA merged) as a Hugging Face directory.
The rollouts, the loop and the save are collective: every rank calls them together.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from zchat.heldout import sampled_requests
from zchat.hybrid import Generation, HybridEngine, RolloutStats
from zchat.train_loop import Recorder
from zserve.sampling import SamplingParams

Scorer = Callable[[list[Any], list[list[int]], list[Generation], str], dict[str, float]]
"""``(prompts, their token ids, the answers, name) -> metrics``: how a stage scores one set
of held-out answers (``name`` is ``"heldout"`` or ``"heldout_sampled"``)."""


class RolloutConfig(Protocol):
    """The keys of a stage config that :class:`Rollouts` reads."""

    actor: Path
    seed: int
    prompts_per_rank: int
    max_new_tokens: int
    temperature: float
    heldout_samples: int


def trim_malloc() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere):
    the backward's freed buffers otherwise stay in this process's resident set."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def grade(tokenizer: Any, prompt: Any, token_ids: list[int]) -> float:
    """1.0 when the answer ``token_ids`` to an arithmetic ``prompt`` is right, else 0.0
    (:func:`zchat.data.check_sum`)."""
    from zchat.data import check_sum, operands_of

    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    return float(check_sum(text, *operands_of(prompt.messages)))


class Rollouts:
    """A rank's prompts and sampled answers (see the module doc)."""

    def __init__(
        self, actor: Any, cfg: RolloutConfig, tokenizer: Any, data: Any, rank: int, world: int
    ) -> None:
        self.actor, self.cfg, self.tokenizer, self.data = actor, cfg, tokenizer, data
        self.rank, self.world = rank, world
        self.hybrid = HybridEngine(actor, cfg.actor)
        self.pad_id = int(tokenizer.pad_token_id)

    def prompts(self, step: int) -> list[Any]:
        """This rank's ``prompts_per_rank`` training prompts of ``step`` (0-based)."""
        n, pool = self.cfg.prompts_per_rank, self.data.prompts_train
        start = (step * self.world + self.rank) * n
        return [pool[(start + k) % len(pool)] for k in range(n)]

    def prompt_ids(self, prompts: list[Any]) -> list[list[int]]:
        """Each prompt rendered with the chat template, as token ids."""
        from zchat.data import render_prompt

        return [render_prompt(self.tokenizer, p.messages) for p in prompts]

    def sample(
        self, step: int, prompts: list[Any]
    ) -> tuple[list[list[int]], list[Generation], RolloutStats]:
        """(token ids, sampled answers, the rollout's stats) of ``prompts`` at ``step``."""
        ids = self.prompt_ids(prompts)
        self.actor.eval()
        seed = self.cfg.seed * 1_000_003 + (step * self.world + self.rank) * len(prompts)
        params = SamplingParams(
            max_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature, seed=seed
        )
        gens, stats = self.hybrid.generate(ids, params)
        return ids, gens, stats

    def heldout(self, score: Scorer) -> dict[str, float]:
        """This rank's share of the held-out prompts answered greedily and, with
        ``heldout_samples``, sampled with fixed seeds; each set scored by ``score``."""
        mine = self.data.prompts_heldout[self.rank :: self.world]
        self.actor.eval()
        ids = self.prompt_ids(mine)
        greedy = SamplingParams(max_tokens=self.cfg.max_new_tokens, temperature=0)
        gens, _ = self.hybrid.generate(ids, greedy)
        out = score(mine, ids, gens, "heldout")
        k = self.cfg.heldout_samples
        if k:
            reps, rep_ids, sampled = sampled_requests(
                mine, ids, k, self.rank, self.cfg.max_new_tokens, self.cfg.temperature
            )
            gens, _ = self.hybrid.generate(rep_ids, sampled)
            out |= score(reps, rep_ids, gens, "heldout_sampled")
        return out


def rollout_loop(
    rec: Recorder,
    steps: int,
    step: Callable[[int], dict[str, Any]],
    evaluate: Callable[[], dict[str, float]],
    line: Callable[[dict[str, Any]], str],
    *,
    eval_every: int = 0,
    evals: Literal["each", "before_after"] = "each",
) -> tuple[dict[str, float], dict[str, float]]:
    """(held-out metrics before the first step, after the last). Each step's record is
    written and shown (``line(record)``) as it ends. ``evals`` "each": every evaluation is a
    record of its own (``{"eval": "before" | "during" | "after", "step": s, ...}``, one
    every ``eval_every`` steps between); "before_after": one record after the last step,
    ``{"eval": "before_after", "before": ..., "after": ...}``."""
    before = evaluate()
    if evals == "each":
        rec.write({"eval": "before", "step": 0, **before})
    for s in range(steps):
        record = step(s)
        rec.write(record)
        rec.progress(line(record))
        if eval_every and (s + 1) % eval_every == 0 and s + 1 < steps:
            rec.write({"eval": "during", "step": s + 1, **evaluate()})
    rec.end_progress()
    after = evaluate()
    if evals == "each":
        rec.write({"eval": "after", "step": steps, **after})
    else:
        rec.write({"eval": "before_after", "before": before, "after": after})
    return before, after


def save_actor(actor: Any, out: Path, source: Path) -> None:
    """The trained actor as a Hugging Face directory ``out`` (a LoRA actor merged into the
    plain architecture), with ``source``'s tokenizer files."""
    import zcore.hf
    from zchat.lora import merge_lora_

    merge_lora_(actor.module)
    zcore.hf.save_pretrained(actor, out, tokenizer_from=source)
