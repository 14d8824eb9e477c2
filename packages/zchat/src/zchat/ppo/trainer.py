"""PPO on ZeRO-3 ranks: rollouts on the hybrid engine, experience from four models, clipped
updates of actor and critic.

Per rank and step (every rank runs this, with its own prompts):

1. rollout: the actor's partitions gathered into zserve's runner, ``prompts_per_rank``
   prompts sampled (:class:`zchat.hybrid.HybridEngine`), released;
2. experience (no gradients): the actor's and the frozen reference's log-probabilities of
   the sampled tokens, the critic's values, the reward model's score of each sequence;
   per-token rewards (KL penalty + clipped score), GAE advantages and returns;
3. ``ppo_epochs`` updates: the actor on the clipped policy loss, the critic on the clipped
   value loss, each its own ZeRO-3 engine (AdamW).

The actor and the critic are ZeRO-3 engines (the critic starts from the reward model); the
reward model is frozen and kept whole on each rank (no optimizer state; at this model size
that is less memory than its ZeRO-3 machinery would save). The reference is a frozen whole
copy of the SFT model too, except with a LoRA-only actor (``only_optimize_lora``,
:mod:`zchat.ppo.models`): its frozen base *is* the SFT model, so the reference's
log-probabilities are the actor's own forward with the LoRA layers off.

:data:`zchat.ppo.config.RECIPE` is what ``z chat ppo`` runs by default; the runs that chose
it: ``benchmarks/results/zchat-ppo.md``.

Metrics (means over ranks; memory and time per rank) go to ``metrics.jsonl`` every step,
with a live progress line on rank 0; the held-out prompts are scored before the first step
and after the last (and every ``eval_every`` steps). The rollouts, the held-out answers and
the loop are GRPO's too (:mod:`zchat.rollouts`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from zchat.lora import lora_disabled
from zchat.ppo.config import PPOConfig
from zchat.ppo.experience import Batch, critic_values, token_logprobs
from zchat.ppo.losses import (
    gae,
    kl_penalized_rewards,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)
from zchat.ppo.models import build_actor, build_critic, check_lora_names
from zchat.rollouts import Rollouts, grade, rollout_loop, save_actor, trim_malloc
from zchat.train_loop import Recorder
from zcore.process import rss_bytes


def _mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return dict(zip(keys, t.tolist(), strict=True))


def _per_rank(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class PPOTrainer:
    """The four models of one rank and the PPO loop over them (collective: every rank
    builds one and calls :meth:`train` together)."""

    def __init__(self, cfg: PPOConfig, rank: int, world: int) -> None:
        from transformers import AutoModelForCausalLM

        from zchat.data import build_chat_data, load_tokenizer, require_nonempty
        from zchat.reward import check_same_tokenizer, load_reward_model

        self.cfg, self.rank, self.world = cfg, rank, world
        self.tokenizer = load_tokenizer(cfg.actor)
        check_same_tokenizer(cfg.reward, self.tokenizer, cfg.actor)
        self.data = build_chat_data(
            cfg.task, train=cfg.train_prompts, heldout=cfg.heldout_prompts, seed=cfg.data_seed
        )
        require_nonempty(self.data.prompts_train, "prompts_train", "raise `train_prompts`")
        require_nonempty(self.data.prompts_heldout, "prompts_heldout", "raise `heldout_prompts`")
        self.actor = build_actor(cfg)
        self.critic = build_critic(cfg)
        # a LoRA-only actor is the reference with its LoRA layers off: no second copy
        self.ref: torch.nn.Module | None = None
        if not (cfg.only_optimize_lora and cfg.actor_lora_dim):
            self.ref = AutoModelForCausalLM.from_pretrained(str(cfg.actor), dtype=torch.float32)
            self.ref.eval().requires_grad_(False)
        self.reward = load_reward_model(cfg.reward)
        self.reward.eval().requires_grad_(False)
        self.rollouts = Rollouts(self.actor, cfg, self.tokenizer, self.data, rank, world)
        self.hybrid = self.rollouts.hybrid
        trim_malloc()  # what loading freed
        self.pad_id = self.rollouts.pad_id

    # -- one step -------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        mem: dict[str, int] = {"start": rss_bytes()}
        t0 = time.perf_counter()
        prompt_ids, gens, rollout = self.rollouts.sample(step, self.rollouts.prompts(step))
        trim_malloc()
        mem |= {f"rollout_{k}": v for k, v in rollout.rss.items() if k != "start"}
        t1 = time.perf_counter()
        batch = Batch.build(prompt_ids, [g.token_ids for g in gens], self.pad_id)
        with torch.no_grad():
            old_lp = token_logprobs(self.actor, batch)
            if self.ref is None:
                with lora_disabled(self.actor.module):
                    ref_lp = token_logprobs(self.actor, batch)
            else:
                ref_lp = token_logprobs(self.ref, batch)
            old_v = critic_values(self.critic, batch)
            scores = self.reward(batch.ids, batch.attn).float()
        rewards = kl_penalized_rewards(
            old_lp, ref_lp, scores, batch.mask, cfg.kl_coef, cfg.clip_reward
        )
        adv, ret = gae(rewards, old_v, batch.mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            adv = masked_whiten(adv, batch.mask)
        trim_malloc()
        mem["experience"] = rss_bytes()
        t2 = time.perf_counter()
        self.actor.train()
        self.critic.train()
        train_actor = step >= cfg.critic_warmup_steps
        # a warm-up step's actor is frozen: no policy loss, and 0 logged for it
        pg, info = torch.zeros(()), {"clip_frac": 0.0, "approx_kl": 0.0}
        for _ in range(cfg.ppo_epochs):
            if train_actor:
                lp = token_logprobs(self.actor, batch)
                pg, info = policy_loss(lp, old_lp, adv, batch.mask, cfg.cliprange)
                self.actor.backward(pg)
                self.actor.step()
            v = critic_values(self.critic, batch)
            vf = value_loss(v, old_v, ret, batch.mask, cfg.cliprange_value)
            self.critic.backward(vf)
            self.critic.step()
        mem["train"] = rss_bytes()
        trim_malloc()
        t3 = time.perf_counter()
        local = {
            "reward": float(scores.mean()),
            "kl": float(masked_mean(old_lp - ref_lp, batch.mask)),
            "actor_loss": float(pg.detach()),
            "actor_trained": float(train_actor),
            "critic_loss": float(vf.detach()),
            "clip_frac": info["clip_frac"],
            "approx_kl": info["approx_kl"],
            "response_tokens": float(batch.mask.sum(1).mean()),
            "advantage": float(masked_mean(adv, batch.mask)),
        }
        out: dict[str, Any] = {"step": step + 1, **_mean_over_ranks(local)}
        timing = {
            "rollout_s": t1 - t0,
            "experience_s": t2 - t1,
            "train_s": t3 - t2,
            "generate_s": rollout.generate_s,
            "gather_s": rollout.gather_s,
            "release_s": rollout.release_s,
            "generated": rollout.generated_tokens,
        }
        per_rank = _per_rank({"mem": mem, "time": timing})
        gen_s = max(r["time"]["generate_s"] for r in per_rank)
        out["gen_tokens_per_s"] = sum(r["time"]["generated"] for r in per_rank) / max(gen_s, 1e-9)
        out["step_s"] = max(
            r["time"]["rollout_s"] + r["time"]["experience_s"] + r["time"]["train_s"]
            for r in per_rank
        )
        out["ranks"] = per_rank
        return out

    # -- held-out score -------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy answers to the held-out prompts (split over ranks), scored by the reward
        model; for arithmetic also the fraction a program grades correct. With
        ``heldout_samples`` k, also k answers per prompt sampled at ``temperature`` with
        fixed seeds (``heldout_sampled_*``)."""
        return self.rollouts.heldout(self._score)

    def _score(
        self, prompts: list[Any], ids: list[list[int]], gens: list[Any], name: str
    ) -> dict[str, float]:
        batch = Batch.build(ids, [g.token_ids for g in gens], self.pad_id)
        with torch.no_grad():
            scores = self.reward(batch.ids, batch.attn).float()
        correct = 0.0
        if self.cfg.task == "arithmetic":
            for p, g in zip(prompts, gens, strict=True):
                correct += grade(self.tokenizer, p, g.token_ids)
        t = torch.tensor([float(scores.sum()), correct, float(len(prompts))], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t)
        total, right, n = t.tolist()
        return {f"{name}_reward": total / n, f"{name}_accuracy": right / n, f"{name}_n": n}

    # -- the loop -------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        rec = Recorder("ppo", cfg.out, cfg.steps, self.rank, path=cfg.out / "metrics.jsonl")
        before, after = rollout_loop(
            rec, cfg.steps, self.step, self.evaluate, self._line, eval_every=cfg.eval_every
        )
        save_actor(self.actor, cfg.out / "actor", cfg.actor)
        return {"before": before, "after": after, "out": str(cfg.out)}

    def _line(self, m: dict[str, Any]) -> str:
        return (
            f"ppo step {m['step']}/{self.cfg.steps}  reward {m['reward']:+.3f}  "
            f"kl {m['kl']:.4f}  actor {m['actor_loss']:+.4f}  critic "
            f"{m['critic_loss']:.4f}  {m['gen_tokens_per_s']:.0f} tok/s  "
            f"{m['step_s']:.1f} s/step"
        )


def prepare_ppo(cfg: PPOConfig) -> None:
    """Checks before any rank starts, each failing with the problem and the fix: the actor
    has a chat template, the reward model is one and shares the actor's tokenizer, each
    LoRA module name matches a linear layer, the prompt splits are not empty."""
    from zchat.data import build_chat_data, load_tokenizer, require_nonempty
    from zchat.reward import check_same_tokenizer

    check_same_tokenizer(cfg.reward, load_tokenizer(cfg.actor), cfg.actor)
    check_lora_names(cfg)
    data = build_chat_data(
        cfg.task, train=cfg.train_prompts, heldout=cfg.heldout_prompts, seed=cfg.data_seed
    )
    require_nonempty(data.prompts_train, "prompts_train", "raise `train_prompts`")
    require_nonempty(data.prompts_heldout, "prompts_heldout", "raise `heldout_prompts`")


def ppo_rank(rank: int, world: int, cfg: PPOConfig) -> dict[str, Any]:
    """One rank of ``z chat ppo`` (the process group is up)."""
    torch.manual_seed(cfg.seed)
    return PPOTrainer(cfg, rank, world).train()
