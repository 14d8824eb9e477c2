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

Measured (SmolLM2-135M-Instruct SFT + reward model of ``z chat sft`` 12 steps x 8 and
``z chat reward`` 20 steps x 4 pairs; 2 gloo ranks, 1 thread each, 2-core box at load
12-13 from other jobs): ``/tmp/zppo/meas.py 10 0,1,2 '{"tag":"lora"}'`` (PPOConfig with
``actor_lora_dim`` = ``critic_lora_dim`` = 8 on ``"layers."``, ``only_optimize_lora``,
LoRA lr 5e-4 (DeepSpeed-Chat's), 8 prompts per rank, ``max_new_tokens`` 8, 10 steps):
a step 125-153 s when nothing else of ours ran (rollout 17-24 s, experience 49-59 s,
training 60-81 s); memory per rank 1.7-2.0 GiB at a step's start, 2.7-3.1 GiB with the rollout's
weights gathered, 3.9-4.4 GiB after training (full fine-tuning before LoRA: 3.1 / 3.7 /
6.3 GB and an OOM kill at step 3); the run's three processes together peaked at 9.2 GiB.
At load 4 a step took 38-42 s (rollout 6 s, experience 15-16 s, training 18-19 s).
Held-out (64 prompts, greedy, 8 tokens; reward model score / ``check_sum`` exact match):
SFT 0.8238 / 0.266; after PPO seeds 0, 1, 2: 0.8282 / 0.250, 0.8235 / 0.266,
0.8316 / 0.234. Reward gain +0.0040 mean over seeds, standard deviation 0.0040, range
0.0080 (-0.0002 to +0.0078); exact match fell (0.250 mean): PPO's held-out bar is *not*
met at this budget (10 steps x 16 rollouts of a reward model with 0.59 held-out pairwise
accuracy). Rollout reward on the training prompts, step 1 -> 10: 0.59 -> 0.75,
0.54 -> 0.81, 0.70 -> 0.65; KL to the reference stayed <= 0.05 per token.

With the block-warmed reward model (:mod:`zchat.reward_blocks`: 0.867 held-out pair
accuracy) and the same LoRA PPO, 10 steps, 1024 training / 128 held-out prompts (the reward
model's split), ``heldout_samples`` 4, 2 ranks, quiet machine (21-29 s a step), seeds 0-2
(``z chat e2e``'s PPO block; seed 0's sampled score was taken from its saved actor, whose
greedy score matched the run's own to the last digit):

    SFT           greedy reward 4.179 (accuracy 0.398); sampled 2.835 (0.178)
    PPO seed 0    greedy 4.157 (0.406); sampled 3.102 (0.221)
    PPO seed 1    greedy 4.229 (0.406); sampled 2.891 (0.189)
    PPO seed 2    greedy 4.197 (0.398); sampled 3.044 (0.197)

The sampled policy's held-out reward (what PPO maximises) rose on every seed: +0.177 mean
against a standard deviation over seeds of 0.109 (range 0.211); the greedy answers' did
not move beyond their spread (+0.015 against 0.036). Rollout reward on training prompts
rose from ~1.4 at step 1 to 2.7-3.6 at step 10, KL <= 0.035 per token.

Not robust across pipelines: ``z chat e2e``'s own run (a fresh SFT model, greedy reward 3.865
/ accuracy 0.359, sampled 3.155 / 0.160, and a fresh block-warmed reward model, 0.859) went
sampled 3.155 -> 3.145 and greedy 3.865 -> 3.806 over the same 10 steps, and so did the same
SFT and reward model with ``whiten_advantages`` (3.155 -> 3.145); its rollout rewards barely
moved (2.7 at step 1, 2.9 at step 10). On the first SFT model ``whiten_advantages`` seed 0
went sampled 2.835 -> 3.072 (greedy 4.179 -> 4.224), like the unwhitened seeds.

On the e2e's own pipeline the larger rollout batch helped: 16 prompts per rank (32 a step),
20 steps, whitened advantages (:data:`zchat.ppo.config.RECIPE`, the e2e's and
``z chat ppo``'s default). Same SFT model (sampled 3.155) and reward model, held-out sampled
reward after 20 steps: seed 0 3.389 (``z chat e2e``'s own run, 38 min end to end), seed 1
3.331, seed 2 3.172 (``z chat ppo --actor RUN/sft --reward RUN/reward --seed S``, 22 min
each). Every seed rose, by +0.143 on average; the seeds' standard deviation is 0.112 and their
range 0.217, so the gain beats the standard deviation but not the range: seed 2 gained only
+0.017. Greedy reward 3.865 -> 3.904 / 3.881 / 3.796, within its spread; greedy exact-match
0.359 -> 0.320 (seed 0) / 0.383 (seed 2): PPO climbs the reward model, not the checker.
Variants that did worse on seeds 0-1: 8 prompts per rank +0.06, a 5-step critic warm-up
(``critic_warmup_steps``) +0.05, lr 1e-3 with ``kl_coef`` 0.04 -0.04.

At LoRA rate 5e-4 the actor hardly moved: KL to the reference <= 0.03 per token on seeds 2
and 3 (seed 3: 3.155 -> 3.200). With the actor's LoRA at 2e-3 (the critic's kept at 5e-4;
now in the recipe), same models, ``z chat ppo --config C --seed S`` (C: the recipe with
``actor_lora_learning_rate`` 2e-3), 14-16 min a run, KL 0.1-0.5 per token by step 10:

    SFT           greedy reward 3.865 (accuracy 0.359); sampled 3.155 (0.160)
    PPO seed 0    greedy 4.085 (0.398); sampled 3.822 (0.291)
    PPO seed 1    greedy 3.844 (0.352); sampled 3.467 (0.205)
    PPO seed 2    greedy 3.886 (0.313); sampled 3.502 (0.195)
    PPO seed 3    greedy 3.874 (0.250); sampled 3.166 (0.104)

Sampled held-out reward +0.334 on average (+0.667 / +0.312 / +0.347 / +0.011); over seeds
its standard deviation is 0.268 and its range 0.656: the mean gain beats the standard
deviation but not the range, and seed 3 gained nothing (its rollout reward had no trend
over the 20 steps of 32 prompts). Greedy reward +0.06 on average: within its spread.
``z chat e2e`` (seed 0, quiet machine) took 25.1 min (SFT 1.9, reward 7.0, PPO 16.0) and
gave seed 0's numbers to the last digit.

Metrics (means over ranks; memory and time per rank) go to ``metrics.jsonl`` every step,
with a live progress line on rank 0; the held-out prompts are scored greedily before the
first step and after the last (and every ``eval_every`` steps).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from zchat.heldout import sampled_requests
from zchat.hybrid import HybridEngine
from zchat.hybrid.engine import rss_bytes
from zchat.lora import lora_disabled, merge_lora_
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
from zserve.sampling import SamplingParams


def trim_malloc() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere):
    the backward's freed buffers otherwise stay in this process's resident set."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
        self.hybrid = HybridEngine(self.actor, cfg.actor)
        trim_malloc()  # what loading freed
        self.pad_id = int(self.tokenizer.pad_token_id)

    # -- one step -------------------------------------------------------------------------
    def _prompts(self, step: int) -> list[Any]:
        n, pool = self.cfg.prompts_per_rank, self.data.prompts_train
        start = (step * self.world + self.rank) * n
        return [pool[(start + k) % len(pool)] for k in range(n)]

    def _prompt_ids(self, prompts: list[Any]) -> list[list[int]]:
        from zchat.data import render_prompt

        return [render_prompt(self.tokenizer, p.messages) for p in prompts]

    def step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        mem: dict[str, int] = {"start": rss_bytes()}
        t0 = time.perf_counter()
        prompt_ids = self._prompt_ids(self._prompts(step))
        self.actor.eval()
        seed = cfg.seed * 1_000_003 + (step * self.world + self.rank) * cfg.prompts_per_rank
        params = SamplingParams(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                seed=seed)  # fmt: skip
        gens, rollout = self.hybrid.generate(prompt_ids, params)
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
        rewards = kl_penalized_rewards(old_lp, ref_lp, scores, batch.mask, cfg.kl_coef,
                                       cfg.clip_reward)  # fmt: skip
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
        timing = {"rollout_s": t1 - t0, "experience_s": t2 - t1, "train_s": t3 - t2,
                  "generate_s": rollout.generate_s, "gather_s": rollout.gather_s,
                  "release_s": rollout.release_s, "generated": rollout.generated_tokens}  # fmt: skip
        per_rank = _per_rank({"mem": mem, "time": timing})
        gen_s = max(r["time"]["generate_s"] for r in per_rank)
        out["gen_tokens_per_s"] = sum(r["time"]["generated"] for r in per_rank) / max(gen_s, 1e-9)
        out["step_s"] = max(r["time"]["rollout_s"] + r["time"]["experience_s"]
                            + r["time"]["train_s"] for r in per_rank)  # fmt: skip
        out["ranks"] = per_rank
        return out

    # -- held-out score -------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy answers to the held-out prompts (split over ranks), scored by the reward
        model; for arithmetic also the fraction a program grades correct. With
        ``heldout_samples`` k, also k answers per prompt sampled at ``temperature`` with
        fixed seeds (``heldout_sampled_*``)."""
        mine = self.data.prompts_heldout[self.rank :: self.world]
        self.actor.eval()
        ids = self._prompt_ids(mine)
        greedy = SamplingParams(max_tokens=self.cfg.max_new_tokens, temperature=0)
        out = self._score(mine, ids, greedy, "heldout")
        k = self.cfg.heldout_samples
        if k:
            reps, rep_ids, sampled = sampled_requests(mine, ids, k, self.rank,
                                                      self.cfg.max_new_tokens, self.cfg.temperature)  # fmt: skip
            out |= self._score(reps, rep_ids, sampled, "heldout_sampled")
        return out

    def _score(self, prompts: list[Any], ids: list[list[int]], params: SamplingParams,
               name: str) -> dict[str, float]:  # fmt: skip
        from zchat.data import check_sum, operands_of

        gens, _ = self.hybrid.generate(ids, params)
        batch = Batch.build(ids, [g.token_ids for g in gens], self.pad_id)
        with torch.no_grad():
            scores = self.reward(batch.ids, batch.attn).float()
        correct = 0.0
        if self.cfg.task == "arithmetic":
            for p, g in zip(prompts, gens, strict=True):
                text = self.tokenizer.decode(g.token_ids, skip_special_tokens=True)
                correct += check_sum(text, *operands_of(p.messages))
        t = torch.tensor([float(scores.sum()), correct, float(len(prompts))], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t)
        total, right, n = t.tolist()
        return {f"{name}_reward": total / n, f"{name}_accuracy": right / n, f"{name}_n": n}

    # -- the loop -------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        import zcore.hf

        cfg = self.cfg
        lead = self.rank == 0
        log = None
        if lead:
            cfg.out.mkdir(parents=True, exist_ok=True)
            log = open(cfg.out / "metrics.jsonl", "w", encoding="utf-8")
        try:
            before = self.evaluate()
            self._write(log, {"eval": "before", "step": 0, **before})
            for step in range(cfg.steps):
                m = self.step(step)
                self._write(log, m)
                if lead:
                    print(
                        f"\rppo step {m['step']}/{cfg.steps}  reward {m['reward']:+.3f}  "
                        f"kl {m['kl']:.4f}  actor {m['actor_loss']:+.4f}  critic "
                        f"{m['critic_loss']:.4f}  {m['gen_tokens_per_s']:.0f} tok/s  "
                        f"{m['step_s']:.1f} s/step",
                        end="", file=sys.stderr, flush=True,
                    )  # fmt: skip
                if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                    self._write(log, {"eval": "during", "step": step + 1, **self.evaluate()})
            if lead:
                print(file=sys.stderr)
            after = self.evaluate()
            self._write(log, {"eval": "after", "step": cfg.steps, **after})
        finally:
            if log is not None:
                log.close()
        merge_lora_(self.actor.module)  # a LoRA actor saves as the plain architecture
        zcore.hf.save_pretrained(self.actor, cfg.out / "actor", tokenizer_from=cfg.actor)
        return {"before": before, "after": after, "out": str(cfg.out)}

    def _write(self, log: Any, record: dict[str, Any]) -> None:
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()


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
