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

``z chat grpo`` runs the LoRA recipe :data:`RECIPE` by default; the class defaults stay
DeepSeekMath's. Measured runs of both: ``benchmarks/results/zchat-grpo.md``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from zchat.ppo.config import check_ranges
from zchat.ppo.experience import Batch, token_logprobs
from zchat.ppo.losses import masked_mean, policy_loss
from zchat.rollouts import Rollouts, grade, rollout_loop, save_actor, trim_malloc
from zchat.train_loop import Recorder
from zcore.config import ZModel

RECIPE: dict[str, Any] = {
    "actor_lora_dim": 8,
    "actor_lora_module_name": "layers.",
    "only_optimize_lora": True,
    "heldout_samples": 4,
    "train_prompts": 1024,
    "heldout_prompts": 128,
}
"""What `z chat grpo` runs with unless the config or a flag says otherwise: the LoRA-only
recipe of ``benchmarks/results/zchat-grpo.md`` ("layers." names a LLaMA-family model's
decoder blocks), 4 fixed-seed sampled answers per held-out prompt, and the 1024 / 128 prompt
split of `z chat e2e`'s stages. The class defaults stay DeepSeekMath's."""


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
            {
                "train_prompts": 1,
                "heldout_prompts": 1,
                "steps": 1,
                "prompts_per_rank": 1,
                "group_size": 2,
                "max_new_tokens": 1,
                "world": 1,
                "threads": 1,
                "actor_lora_dim": 0,
                "heldout_samples": 0,
            },
            ("temperature", "cliprange", "lr", "actor_lora_learning_rate"),
        )
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


def grpo_backward(
    actor: Any,
    ref_lp: torch.Tensor,
    batch: Batch,
    adv: torch.Tensor,
    micro: int,
    kl_coef: float,
    clip: float,
) -> tuple[float, float, float]:
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


def prepare_grpo(cfg: GRPOConfig) -> None:
    """Checks before any rank starts, each naming the problem and the fix: the actor has a
    chat template, the LoRA module name matches a linear layer, the prompt splits are not
    empty."""
    from zchat.data import build_chat_data, load_tokenizer, require_nonempty
    from zchat.ppo.models import check_lora_name

    load_tokenizer(cfg.actor)
    check_lora_name(
        cfg.actor_lora_dim, cfg.actor, cfg.actor_lora_module_name, "actor_lora_module_name"
    )
    data = build_chat_data(
        cfg.task, train=cfg.train_prompts, heldout=cfg.heldout_prompts, seed=cfg.data_seed
    )
    require_nonempty(data.prompts_train, "prompts_train", "raise `train_prompts`")
    require_nonempty(data.prompts_heldout, "prompts_heldout", "raise `heldout_prompts`")


def ds_config(cfg: GRPOConfig) -> dict[str, Any]:
    """The actor's ZeRO-3 config: a rank's rollout in micro-batches of ``micro_batch`` rows
    whose gradients accumulate into one AdamW step."""
    rollout = cfg.prompts_per_rank * cfg.group_size
    micro = cfg.micro_batch or rollout
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": rollout // micro,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3},
        "comm_timeout_s": 600,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": 0.0}},
    }


class GRPOTrainer:
    """The actor (and, without LoRA-only training, a frozen reference) of one rank and the
    GRPO loop over them (collective: every rank builds one and calls :meth:`train`)."""

    def __init__(self, cfg: GRPOConfig, rank: int, world: int) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        import zcore
        import zcore.hf
        from zchat.data import build_chat_data, load_tokenizer
        from zchat.ppo.models import lora_param_groups

        self.cfg, self.rank, self.world = cfg, rank, world
        self.tokenizer = load_tokenizer(cfg.actor)
        self.data = build_chat_data(
            cfg.task, train=cfg.train_prompts, heldout=cfg.heldout_prompts, seed=cfg.data_seed
        )
        ds = ds_config(cfg)
        self.micro = ds["train_micro_batch_size_per_gpu"]
        model = zcore.hf.from_pretrained(
            AutoModelForCausalLM,
            cfg.actor,
            ds_config=ds,
            config=AutoConfig.from_pretrained(str(cfg.actor)),
        )
        groups = lora_param_groups(
            model,
            cfg.actor_lora_dim,
            cfg.actor_lora_module_name,
            "actor_lora_module_name",
            cfg.only_optimize_lora,
            cfg.actor_lora_learning_rate,
        )
        self.actor, *_ = zcore.initialize(model, model_parameters=groups, config=ds)
        self.ref: Any = self.actor  # a LoRA-only actor's frozen base is the reference
        if not (cfg.only_optimize_lora and cfg.actor_lora_dim):
            self.ref = AutoModelForCausalLM.from_pretrained(str(cfg.actor), dtype=torch.float32)
            self.ref.eval().requires_grad_(False)
        self.rollouts = Rollouts(self.actor, cfg, self.tokenizer, self.data, rank, world)
        trim_malloc()

    def step(self, step: int) -> dict[str, Any]:
        """One rollout of ``prompts_per_rank`` prompts x ``group_size`` samples and one
        actor update; the record of the step (means over ranks)."""
        cfg, world = self.cfg, self.world
        t0 = time.perf_counter()
        grouped = [p for p in self.rollouts.prompts(step) for _ in range(cfg.group_size)]
        ids, gens, roll = self.rollouts.sample(step, grouped)
        rewards = torch.tensor(
            [grade(self.tokenizer, p, g.token_ids) for p, g in zip(grouped, gens, strict=True)]
        )
        batch = Batch.build(ids, [g.token_ids for g in gens], int(self.tokenizer.pad_token_id))
        adv = group_advantages(rewards, cfg.group_size)[:, None] * batch.mask
        ref_lp = ref_logprobs(self.ref, batch, self.micro)
        self.actor.train()
        loss, kl, clip_frac = grpo_backward(
            self.actor, ref_lp, batch, adv, self.micro, cfg.kl_coef, cfg.cliprange
        )
        trim_malloc()
        t = torch.tensor(
            [float(rewards.mean()), kl, loss, float(roll.generated_tokens), roll.generate_s],
            dtype=torch.float64,
        )
        if dist.is_initialized():
            dist.all_reduce(t)
        return {
            "step": step + 1,
            "reward": float(t[0]) / world,
            "kl": float(t[1]) / world,
            "loss": float(t[2]) / world,
            "gen_tokens_per_s": float(t[3] / t[4]) * world,
            "clip_frac": clip_frac,
            "step_s": time.perf_counter() - t0,
        }

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy of greedy answers and, with ``heldout_samples``, of fixed-seed
        sampled ones (``heldout_sampled_accuracy``), over all ranks."""
        return self.rollouts.heldout(self._accuracy)

    def _accuracy(
        self, prompts: list[Any], ids: list[list[int]], gens: list[Any], name: str
    ) -> dict[str, float]:
        right = sum(
            grade(self.tokenizer, p, g.token_ids) for p, g in zip(prompts, gens, strict=True)
        )
        t = torch.tensor([right, float(len(prompts))], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t)
        return {f"{name}_accuracy": float(t[0] / t[1])}

    def train(self) -> dict[str, Any]:
        """The loop (:func:`zchat.rollouts.rollout_loop`), then the actor saved to
        ``out/actor``; the held-out metrics before and after (``<key>_before``, ...)."""
        cfg = self.cfg
        rec = Recorder("grpo", cfg.out, cfg.steps, self.rank, path=cfg.out / "metrics.jsonl")
        before, after = rollout_loop(
            rec, cfg.steps, self.step, self.evaluate, self._line, evals="before_after"
        )
        save_actor(self.actor, cfg.out / "actor", cfg.actor)
        result: dict[str, Any] = {"out": str(cfg.out)}
        for key in before:
            result[f"{key}_before"], result[f"{key}_after"] = before[key], after[key]
        return result

    def _line(self, m: dict[str, Any]) -> str:
        return (
            f"grpo step {m['step']}/{self.cfg.steps}  reward {m['reward']:.3f}  kl "
            f"{m['kl']:.4f}  loss {m['loss']:+.4f}  {m['step_s']:.1f} s/step"
        )


def grpo_rank(rank: int, world: int, cfg: GRPOConfig) -> dict[str, Any]:
    """One rank of ``z chat grpo`` (collective)."""
    torch.manual_seed(cfg.seed)
    return GRPOTrainer(cfg, rank, world).train()
