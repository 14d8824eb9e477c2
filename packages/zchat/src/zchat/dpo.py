"""Direct Preference Optimization (``z chat dpo``) under ZeRO-3, with a frozen reference.

Loss (Rafailov et al. 2023), per pair, with ``log π(y|x)`` summed over the answer tokens::

    z = beta * ((log π(chosen) - log π_ref(chosen)) - (log π(rejected) - log π_ref(rejected)))
    loss = -(1 - eps) * logsigmoid(z) - eps * logsigmoid(-z)      (eps: label smoothing)

The reference is the starting (SFT) policy, frozen. Its log-probabilities of every pair this
run reads (the training pairs of every step, the held-out pairs) are computed once, before
the first update, by the same ZeRO-3 engine in eval mode: exactly a frozen copy's values,
without a second partitioned model in memory or a second forward per step.

Held-out metrics, before and after: ``pref_accuracy``, the fraction of held-out pairs whose
chosen answer the policy gives more log-probability than the rejected one (for arithmetic:
prefers the correct sum); ``exact_match``, teacher-forced greedy correctness of the chosen
answer (program-checkable: every answer token is the argmax); and after training the
implicit-reward accuracy (``z > 0``) and mean margin ``z`` (both 0 before by construction).

Measured runs: ``benchmarks/results/zchat-dpo.md``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from zchat.config import StageConfig
from zchat.data import PreferencePair, SFTExample, load_tokenizer, require_nonempty
from zchat.reward_train import pair_batch
from zchat.sft import Plays, build_stage_data, check_model_dir, evaluate_answers
from zchat.train_loop import (
    Recorder,
    all_sum,
    answer_logps,
    causal_lm_class,
    ds_config,
    global_batches,
    heldout_shard,
    lr_factor,
    rank_micro_batches,
    scheduler_for,
)


class DPOConfig(StageConfig):
    """``z chat dpo``; ``model`` is the SFT output. ``beta`` 0.1 and ``label_smoothing`` 0 are
    DeepSpeed-Chat's DPO defaults; ``lr`` 1e-6 is zchat's (DPO's usual 5e-7..5e-6 range)."""

    lr: float = 1e-6
    beta: float = 0.1
    """Strength of the KL-like anchor to the reference (larger: stay closer)."""
    label_smoothing: float = 0.0
    """Probability that a pair's label is flipped (conservative DPO); 0 is plain DPO."""

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        if not self.beta > 0:
            raise ValueError(f"`beta` must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"`label_smoothing` must be in [0, 0.5), got {self.label_smoothing}")


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, per-pair implicit-reward margin ``z`` ``[B]``) from summed answer
    log-probabilities ``[B]`` of the policy and the reference."""
    z = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
    loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return loss.mean(), z


def pair_logps(
    model: Any, tokenizer: Any, pairs: list[PreferencePair], max_len: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(log π(chosen) ``[B]``, log π(rejected) ``[B]``, tokens in the batch): log-probs summed
    over answer tokens, one forward."""
    b = pair_batch(tokenizer, pairs, max_len)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    per_token, _ = answer_logps(logits, b["input_ids"], b["labels"])
    sums = per_token.sum(1)
    return sums[: len(pairs)], sums[len(pairs) :], int(b["attention_mask"].sum())


def prepare_dpo(cfg: DPOConfig, plays: tuple[Plays, Plays] = (None, None)) -> None:
    """Checks before ranks start: weights, chat template, non-empty pair splits."""
    check_model_dir(cfg.model)
    data = build_stage_data(cfg, plays)
    require_nonempty(data.pairs_train, "pairs_train", "raise `train_examples`")
    require_nonempty(data.pairs_heldout, "pairs_heldout", "raise `heldout_examples`")


def _reference(
    engine: Any, tokenizer: Any, batches: list[list[PreferencePair]], max_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    engine.eval()
    with torch.no_grad():
        return [pair_logps(engine, tokenizer, b, max_len)[:2] for b in batches]


def evaluate_dpo(
    engine: Any,
    tokenizer: Any,
    held: list[list[tuple[PreferencePair, bool]]],
    refs: list[tuple[torch.Tensor, torch.Tensor]],
    cfg: DPOConfig,
) -> dict[str, float]:
    """Held-out pref_accuracy, implicit-reward accuracy and margin over all ranks."""
    pref = implicit = margin = counted = 0.0
    engine.eval()
    with torch.no_grad():
        for batch, (rc, rr) in zip(held, refs, strict=True):
            pc, pr, _ = pair_logps(engine, tokenizer, [p for p, _ in batch], cfg.max_len)
            _, z = dpo_loss(pc, pr, rc, rr, cfg.beta)
            keep = torch.tensor([k for _, k in batch], dtype=torch.float64)
            pref += float(((pc > pr).double() * keep).sum())
            implicit += float(((z > 0).double() * keep).sum())
            margin += float((z.double() * keep).sum())
            counted += float(keep.sum())
    pref, implicit, margin, counted = all_sum(pref, implicit, margin, counted)
    n = max(counted, 1.0)
    return {"pref_accuracy": pref / n, "implicit_accuracy": implicit / n, "margin": margin / n}


def train_dpo(
    rank: int, world: int, cfg: DPOConfig, plays: tuple[Plays, Plays] = (None, None)
) -> dict[str, Any]:
    """One rank of ``z chat dpo`` (collective): reference pass, train, evaluate, save."""
    import zcore
    import zcore.hf

    start = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    data = build_stage_data(cfg, plays)
    ds = ds_config(cfg, world)
    model = zcore.hf.from_pretrained(causal_lm_class(cfg.model), cfg.model, ds_config=ds)
    engine, *_ = zcore.initialize(model, config=ds, lr_scheduler=scheduler_for(cfg))
    rec = Recorder("dpo", cfg.out, cfg.steps, rank)
    per_step = cfg.micro_batch * cfg.grad_accum * world
    steps = global_batches(data.pairs_train, per_step, cfg.steps, cfg.seed)
    micros = [rank_micro_batches(b, rank, world, cfg.micro_batch) for b in steps]
    held = heldout_shard(data.pairs_heldout, rank, world, cfg.eval_batch)
    ref_start = time.perf_counter()
    ref_train = _reference(engine, tokenizer, [m for ms in micros for m in ms], cfg.max_len)
    ref_held = _reference(engine, tokenizer, [[p for p, _ in b] for b in held], cfg.max_len)
    ref_s = time.perf_counter() - ref_start
    chosen = [SFTExample(p.messages, p.chosen) for p in data.pairs_heldout]

    def evaluate() -> dict[str, float]:
        answers = evaluate_answers(engine, tokenizer, chosen, cfg, rank, world)
        return {
            **evaluate_dpo(engine, tokenizer, held, ref_held, cfg),
            "exact_match": answers["exact_match"],
        }

    before = evaluate()
    rec.write({"stage": "dpo", "step": 0, **{f"heldout_{k}": v for k, v in before.items()}})
    losses = []
    refs = iter(ref_train)
    train_start = time.perf_counter()
    for step, mine in enumerate(micros, 1):
        engine.train()
        loss_sum = right = seen = 0.0
        for micro in mine:
            rc, rr = next(refs)
            pc, pr, tokens = pair_logps(engine, tokenizer, micro, cfg.max_len)
            loss, z = dpo_loss(pc, pr, rc, rr, cfg.beta, cfg.label_smoothing)
            engine.backward(loss)
            engine.step()
            loss_sum += float(loss.detach()) * len(micro)
            right += float((z > 0).sum())
            seen += tokens
        loss_all, right_all, seen_all = all_sum(loss_sum, right, seen)
        losses.append(loss_all / per_step)
        if step % cfg.log_every == 0 or step == cfg.steps:
            rec.step(
                step,
                int(seen_all),
                loss=losses[-1],
                implicit_acc=right_all / per_step,
                lr=cfg.lr * lr_factor(cfg, step - 1),
            )
    train_s = time.perf_counter() - train_start
    after = evaluate()
    rec.write({"stage": "dpo", "step": cfg.steps, **{f"heldout_{k}": v for k, v in after.items()}})
    zcore.hf.save_pretrained(engine, cfg.out, tokenizer_from=cfg.model)
    engine.destroy()
    return {
        "losses": losses,
        "heldout_before": before,
        "heldout_after": after,
        "out": cfg.out,
        "metrics": str(rec.path),
        "reference_s": ref_s,
        "train_s": train_s,
        "total_s": time.perf_counter() - start,
    }
