"""GRPO (DeepSeekMath's group-relative policy optimization) with a program-verifiable reward.

No critic and no reward model: every prompt is sampled ``group_size`` times on the hybrid
engine, each answer is graded by a program (arithmetic: :func:`zchat.data.check_sum`, 1 if
the first number is the sum, else 0), and an answer's advantage is its reward standardised
within its group, ``(r - mean_group) / (std_group + eps)``, on every one of its tokens. The
actor (ZeRO-3) minimises PPO's clipped surrogate with those advantages plus
``kl_coef * KL(actor || reference)`` per token, estimated as ``exp(ref - logp) - (ref - logp)
- 1`` (the unbiased, non-negative "k3" estimator DeepSeekMath uses); the reference is the
frozen starting model. A group whose answers all score alike has advantage 0 everywhere and
teaches nothing, which is why the group is sampled (temperature 1).

The held-out metric is the fraction of held-out prompts answered correctly, greedily (the
mean program reward of greedy answers: the grade is 0 or 1).

``z chat grpo`` runs the LoRA recipe :data:`RECIPE` by default (at the class defaults,
whole-model GRPO with DeepSeekMath's lr 1e-6, 20 CPU-sized steps did not move the held-out
accuracy beyond its spread). Measured runs: ``benchmarks/results/zchat-grpo.md``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from zchat.hybrid import HybridEngine
from zchat.ppo.config import check_ranges
from zchat.ppo.experience import Batch, token_logprobs
from zchat.ppo.losses import masked_mean, policy_loss
from zcore.config import ZModel
from zserve.sampling import SamplingParams

RECIPE: dict[str, Any] = {
    "actor_lora_dim": 8, "actor_lora_module_name": "layers.", "only_optimize_lora": True,
    "heldout_samples": 4, "train_prompts": 1024, "heldout_prompts": 128,
}  # fmt: skip
"""What `z chat grpo` runs with unless the config or a flag says otherwise: the LoRA-only
recipe of ``benchmarks/results/zchat-grpo.md`` ("layers." names a LLaMA-family model's decoder blocks), 4 fixed-seed
sampled answers per held-out prompt, and the 1024 / 128 prompt split of `z chat e2e`'s
stages. The class defaults stay DeepSeekMath's."""


class GRPOConfig(ZModel):
    """``z chat grpo``; unknown keys are refused."""

    actor: Path
    """The model to train (the SFT output); the reference is a frozen copy."""
    out: Path
    task: Literal["arithmetic"] = "arithmetic"
    """Only arithmetic has a program that grades an answer."""
    data_seed: int = 0
    train_prompts: int = 256
    heldout_prompts: int = 64
    steps: int = 20
    prompts_per_rank: int = 4
    group_size: int = 4
    """Samples per prompt (DeepSeekMath used 64; CPU-sized here)."""
    max_new_tokens: int = 8
    micro_batch: int = 0
    """Sequences per actor forward/backward; a rank's rollout (``prompts_per_rank *
    group_size``) is split into micro-batches whose gradients accumulate (same loss, less
    activation memory). 0: the whole rollout at once."""
    temperature: float = 1.0
    kl_coef: float = 0.04
    """Weight of the per-token KL to the reference (DeepSeekMath's beta 0.04)."""
    cliprange: float = 0.2
    lr: float = 1e-6
    """AdamW learning rate (DeepSeekMath's 1e-6)."""
    actor_lora_dim: int = 0
    """LoRA rank of the actor's matched linear layers (0: no LoRA); PPO's key and meaning."""
    actor_lora_module_name: str = "decoder.layers."
    """Comma-separated name parts: a linear layer whose name contains one gets LoRA
    (DeepSpeed-Chat's default names OPT's layers; LLaMA-family models need ``"layers."``)."""
    only_optimize_lora: bool = False
    """Train only the LoRA matrices; the frozen base is then the reference (its forward with
    the LoRA layers off), so no second copy of the model is kept."""
    actor_lora_learning_rate: float = 5e-4
    """The LoRA matrices' AdamW rate (DeepSpeed-Chat's); other parameters keep ``lr``."""
    heldout_samples: int = 0
    """Also sample this many answers per held-out prompt at ``temperature`` with fixed seeds
    (:mod:`zchat.heldout`) and report their accuracy: the expected reward of the sampling
    policy, which is what GRPO maximises. 0: greedy answers only."""
    seed: int = 0
    world: int = 2
    threads: int = 1

    def model_post_init(self, context: Any, /) -> None:
        check_ranges(
            self,
            {"train_prompts": 1, "heldout_prompts": 1, "steps": 1, "prompts_per_rank": 1,
             "group_size": 2, "max_new_tokens": 1, "world": 1, "threads": 1,
             "actor_lora_dim": 0, "heldout_samples": 0},
            ("temperature", "cliprange", "lr", "actor_lora_learning_rate"),
        )  # fmt: skip
        rollout = self.prompts_per_rank * self.group_size
        if self.micro_batch < 0 or (self.micro_batch and rollout % self.micro_batch):
            raise ValueError(
                f"`micro_batch` {self.micro_batch} must be 0 or divide prompts_per_rank * "
                f"group_size = {rollout}; pick a divisor of {rollout}"
            )
        if self.kl_coef < 0:
            raise ValueError(f"`kl_coef` {self.kl_coef} < 0; use a value >= 0 (0 turns it off)")
        if self.only_optimize_lora and not self.actor_lora_dim:
            raise ValueError(
                "`only_optimize_lora` needs LoRA: set `actor_lora_dim` > 0, or turn "
                "`only_optimize_lora` off (the whole model trains)"
            )


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """``rewards [N * group_size]`` (groups contiguous) standardised within each group."""
    r = rewards.view(-1, group_size).float()
    mean, std = r.mean(1, keepdim=True), r.std(1, keepdim=True)
    return ((r - mean) / (std + eps)).view(-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(actor || ref)`` estimate ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def rows(batch: Batch, sl: slice) -> Batch:
    """The rows ``sl`` of a rollout batch."""
    return Batch(batch.ids[sl], batch.attn[sl], batch.index[sl], batch.mask[sl], batch.targets[sl])


def ref_logprobs(ref: Any, batch: Batch, micro: int) -> torch.Tensor:
    """The reference's log-probabilities of a rollout's tokens, ``micro`` rows per forward
    (no gradients). ``ref`` is a frozen model, or a LoRA actor engine whose LoRA layers are
    switched off for the forward (:func:`zchat.lora.lora_disabled`)."""
    from zchat.lora import lora_disabled

    module = getattr(ref, "module", ref)
    out = []
    with torch.no_grad(), lora_disabled(module):
        for start in range(0, len(batch.ids), micro):
            out.append(token_logprobs(ref, rows(batch, slice(start, start + micro))))
    return torch.cat(out)


def grpo_backward(actor: Any, ref_lp: torch.Tensor, batch: Batch, adv: torch.Tensor, micro: int,
                  kl_coef: float, clip: float) -> tuple[float, float, float]:  # fmt: skip
    """Backward of GRPO's loss over a rank's rollout, ``micro`` rows per forward, each
    followed by ``actor.step()`` (a ZeRO engine configured with ``len(batch.ids) // micro``
    accumulation steps, so the optimizer steps once, after the last). ``ref_lp``: the
    reference's log-probabilities of the rollout (:func:`ref_logprobs`). Each micro-batch's
    loss is weighted by its share of the rollout's response tokens, so the accumulated
    gradient is that of the token mean over the whole rollout. Returns (loss, KL, clip
    fraction) over the rollout."""
    n, total = len(batch.ids), float(batch.mask.sum().clamp(min=1.0))
    accum = n // micro
    loss_sum = kl_sum = clip_sum = 0.0
    for start in range(0, n, micro):
        part = rows(batch, slice(start, start + micro))
        lp = token_logprobs(actor, part)
        # One update per rollout: the rollout policy is the current one, so its log-probs
        # are ``lp.detach()`` (no dropout in these models): no second actor forward.
        pg, info = policy_loss(lp, lp.detach(), adv[start : start + micro], part.mask, clip)
        kl = masked_mean(kl_k3(lp, ref_lp[start : start + micro]), part.mask)
        share = float(part.mask.sum()) / total
        actor.backward((pg + kl_coef * kl) * (share * accum))
        actor.step()
        loss_sum += float((pg + kl_coef * kl).detach()) * share
        kl_sum += float(kl.detach()) * share
        clip_sum += info["clip_frac"] * share
    return loss_sum, kl_sum, clip_sum


def _grade(tokenizer: Any, prompt: Any, token_ids: list[int]) -> float:
    from zchat.data import check_sum, operands_of

    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    return float(check_sum(text, *operands_of(prompt.messages)))


def prepare_grpo(cfg: GRPOConfig) -> None:
    """Checks before any rank starts, each naming the problem and the fix: the actor has a
    chat template, the LoRA module name matches a linear layer, the prompt splits are not
    empty."""
    from zchat.data import build_chat_data, load_tokenizer, require_nonempty
    from zchat.ppo.models import check_lora_name

    load_tokenizer(cfg.actor)
    check_lora_name(cfg.actor_lora_dim, cfg.actor, cfg.actor_lora_module_name,
                    "actor_lora_module_name")  # fmt: skip
    data = build_chat_data(cfg.task, train=cfg.train_prompts, heldout=cfg.heldout_prompts,
                           seed=cfg.data_seed)  # fmt: skip
    require_nonempty(data.prompts_train, "prompts_train", "raise `train_prompts`")
    require_nonempty(data.prompts_heldout, "prompts_heldout", "raise `heldout_prompts`")


def grpo_rank(rank: int, world: int, cfg: GRPOConfig) -> dict[str, Any]:
    """One rank of ``z chat grpo`` (collective)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import zcore
    import zcore.hf
    from zchat.data import build_chat_data, load_tokenizer, render_prompt
    from zchat.heldout import sampled_requests
    from zchat.lora import merge_lora_
    from zchat.ppo.models import lora_param_groups
    from zchat.ppo.trainer import trim_malloc

    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(cfg.actor)
    data = build_chat_data(cfg.task, train=cfg.train_prompts, heldout=cfg.heldout_prompts,
                           seed=cfg.data_seed)  # fmt: skip
    rollout = cfg.prompts_per_rank * cfg.group_size
    micro = cfg.micro_batch or rollout
    ds = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": rollout // micro,
          "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}, "comm_timeout_s": 600,
          "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": 0.0}}}  # fmt: skip
    model = zcore.hf.from_pretrained(AutoModelForCausalLM, cfg.actor, ds_config=ds,
                                     config=AutoConfig.from_pretrained(str(cfg.actor)))  # fmt: skip
    groups = lora_param_groups(model, cfg.actor_lora_dim, cfg.actor_lora_module_name,
                               "actor_lora_module_name", cfg.only_optimize_lora,
                               cfg.actor_lora_learning_rate)  # fmt: skip
    actor, *_ = zcore.initialize(model, model_parameters=groups, config=ds)
    ref: Any = actor  # a LoRA-only actor's frozen base is the reference (LoRA off)
    if not (cfg.only_optimize_lora and cfg.actor_lora_dim):
        ref = AutoModelForCausalLM.from_pretrained(str(cfg.actor), dtype=torch.float32)
        ref.eval().requires_grad_(False)
    hybrid = HybridEngine(actor, cfg.actor)
    trim_malloc()

    def accuracy(prompts: list[Any], ids: list[list[int]], params: SamplingParams) -> float:
        gens, _ = hybrid.generate(ids, params)
        right = sum(_grade(tok, p, g.token_ids) for p, g in zip(prompts, gens, strict=True))
        t = torch.tensor([right, float(len(prompts))], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t)
        return float(t[0] / t[1])

    def evaluate() -> dict[str, float]:
        mine = data.prompts_heldout[rank::world]
        actor.eval()
        ids = [render_prompt(tok, p.messages) for p in mine]
        out = {"heldout_accuracy": accuracy(mine, ids, SamplingParams(
            max_tokens=cfg.max_new_tokens, temperature=0))}  # fmt: skip
        if cfg.heldout_samples:
            reps, rep_ids, params = sampled_requests(mine, ids, cfg.heldout_samples, rank,
                                                     cfg.max_new_tokens, cfg.temperature)  # fmt: skip
            out["heldout_sampled_accuracy"] = accuracy(reps, rep_ids, params)
        return out

    log = None
    if rank == 0:
        cfg.out.mkdir(parents=True, exist_ok=True)
        log = open(cfg.out / "metrics.jsonl", "w", encoding="utf-8")
    before = evaluate()
    pool, n = data.prompts_train, cfg.prompts_per_rank
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        start = (step * world + rank) * n
        prompts = [pool[(start + k) % len(pool)] for k in range(n)]
        grouped = [p for p in prompts for _ in range(cfg.group_size)]
        ids = [render_prompt(tok, p.messages) for p in grouped]
        actor.eval()
        seed = cfg.seed * 1_000_003 + (step * world + rank) * len(grouped)
        gens, roll = hybrid.generate(ids, SamplingParams(max_tokens=cfg.max_new_tokens,
                                                         temperature=cfg.temperature, seed=seed))  # fmt: skip
        rewards = torch.tensor(
            [_grade(tok, p, g.token_ids) for p, g in zip(grouped, gens, strict=True)]
        )
        batch = Batch.build(ids, [g.token_ids for g in gens], int(tok.pad_token_id))
        adv = group_advantages(rewards, cfg.group_size)[:, None] * batch.mask
        ref_lp = ref_logprobs(ref, batch, micro)
        actor.train()
        loss, kl, clip_frac = grpo_backward(actor, ref_lp, batch, adv, micro, cfg.kl_coef,
                                            cfg.cliprange)  # fmt: skip
        trim_malloc()
        t = torch.tensor([float(rewards.mean()), kl, loss,
                          float(roll.generated_tokens), roll.generate_s], dtype=torch.float64)  # fmt: skip
        if dist.is_initialized():
            dist.all_reduce(t)
        m = {"step": step + 1, "reward": float(t[0]) / world, "kl": float(t[1]) / world,
             "loss": float(t[2]) / world, "gen_tokens_per_s": float(t[3] / t[4]) * world,
             "clip_frac": clip_frac, "step_s": time.perf_counter() - t0}  # fmt: skip
        if log is not None:
            log.write(json.dumps(m) + "\n")
            log.flush()
            print(f"\rgrpo step {m['step']}/{cfg.steps}  reward {m['reward']:.3f}  kl "
                  f"{m['kl']:.4f}  loss {m['loss']:+.4f}  {m['step_s']:.1f} s/step", end="",
                  file=sys.stderr, flush=True)  # fmt: skip
    after = evaluate()
    if log is not None:
        print(file=sys.stderr)
        log.write(json.dumps({"eval": "before_after", "before": before, "after": after}) + "\n")
        log.close()
    merge_lora_(actor.module)  # a LoRA actor saves as the plain architecture
    zcore.hf.save_pretrained(actor, cfg.out / "actor", tokenizer_from=cfg.actor)
    result: dict[str, Any] = {"out": str(cfg.out)}
    for key in before:
        result[f"{key}_before"], result[f"{key}_after"] = before[key], after[key]
    return result
