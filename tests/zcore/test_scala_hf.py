"""ScaLA on Hugging Face models (BERT encoder, LLaMA decoder) through the zcore engine on 2 gloo
ranks, ZeRO stages 0-2, against plain references. Slow (each rank imports transformers, about
a minute per call on a loaded 2-core machine); test_scala_engine.py runs the same checks on a
small torch model in the fast suite.

- *bound 0*: ``scala`` enabled with ``adv_max_norm`` 0 (2 ascent passes still run) trains
  bit for bit like the plain engine loop, dropout on: the ascent passes leave neither
  gradients nor a different RNG stream behind.
- *reference*: ScaLA (2 ascent steps, l2 ball, padded batches, gradient accumulation 2) on 2
  ranks trains like a readable single-process torch loop on the whole batch: PGA on
  ``inputs_embeds = word_embeddings(ids) + delta`` written out from the definition, then
  torch AdamW. Tolerances (fp32): per-step losses rel 1e-5 (the ranks sum in another
  order); outputs on a probe atol 1e-5; weights atol 5e-5 except attention's key bias, whose
  exact gradient is 0 and computed one fp32 noise that AdamW turns into lr-sized steps
  (softmax ignores it, so the outputs check covers it).
- a causal decoder (tiny LLaMA) takes the same path at stage 2, and the noise changes its
  training (so the test above is not vacuous).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.utils.distributed import run_ranks

MB, GAS, WORLD, SEQ, STEPS = 2, 2, 2, 12, 3
GLOBAL = MB * GAS * WORLD
LR, WD = 2e-3, 0.01
SCALA = {"enabled": True, "adv_steps": 2, "adv_step_size": 0.3, "adv_max_norm": 0.5}
NOISE_ONLY = ("attention.self.key.bias",)


def tiny_bert(dropout: float) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return BertForSequenceClassification(cfg)


def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


def batch(step: int) -> dict[str, torch.Tensor]:
    """The global batch of `step`: token ids, a right-padded attention mask, labels."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, 97, (GLOBAL, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (GLOBAL,), generator=g)
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "labels": torch.randint(0, 3, (GLOBAL,), generator=g),
    }


def micro(step: int, m: int, rank: int) -> dict[str, torch.Tensor]:
    i = (m * WORLD + rank) * MB
    return {k: v[i : i + MB] for k, v in batch(step).items()}


def ds_config(stage: int, scala: dict[str, Any] | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},
        "comm_timeout_s": 60,
    }
    if scala is not None:
        cfg["scala"] = scala
    return cfg


def _train(stage: int, model: Any, scala: dict[str, Any] | None, causal: bool = False) -> dict:
    import torch.distributed as dist

    import zcore
    import zcore.scala  # registers the `scala` block before the config is read
    from tests.zcore.zero.common import full_params

    engine, *_ = zcore.initialize(model, config=ds_config(stage, scala))
    engine.train()
    runner = zcore.scala.ScaLA(engine)  # reads the config's `scala` block
    losses, norms = [], []
    for step in range(STEPS):
        total = torch.zeros(1)
        for m in range(GAS):
            b = micro(step, m, engine.rank)
            if causal:
                b = {
                    "input_ids": b["input_ids"],
                    "attention_mask": b["attention_mask"],
                    "labels": b["input_ids"].masked_fill(b["attention_mask"] == 0, -100),
                }

            def loss_fn(b: dict[str, torch.Tensor] = b) -> torch.Tensor:
                return engine(**b).loss

            r = runner.step(loss_fn, mask=b["attention_mask"])
            total += r.loss
            norms.append(r.delta_norm)
        dist.all_reduce(total)
        losses.append(float(total) / (GAS * WORLD))
    engine.eval()
    probe = batch(99)
    with torch.no_grad():
        out = engine(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"])
    runner.close()
    return {
        "losses": losses,
        "params": full_params(engine),
        "logits": out.logits.float(),
        "norms": norms,
    }


def _rank_bound0(rank: int, world: int, stage: int) -> dict:
    plain = _train(stage, tiny_bert(0.1), None)
    zero = _train(stage, tiny_bert(0.1), {**SCALA, "adv_max_norm": 0.0})
    real = _train(stage, tiny_bert(0.0), SCALA)
    return {"plain": plain, "zero": zero, "real": real}


def reference(scala: dict[str, Any]) -> dict:
    """One process, whole batch: PGA on the embedding output from its definition, then AdamW."""
    model = tiny_bert(0.0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    embed = model.get_input_embeddings()
    eps, alpha = scala["adv_max_norm"], scala["adv_step_size"]
    losses = []
    for step in range(STEPS):
        b = batch(step)
        keep = b["attention_mask"][..., None].float()  # (B, T, 1)

        def loss_at(delta: torch.Tensor, b: dict[str, torch.Tensor] = b) -> torch.Tensor:
            return model(
                inputs_embeds=embed(b["input_ids"]) + delta,
                attention_mask=b["attention_mask"],
                labels=b["labels"],
            ).loss

        delta = torch.zeros(GLOBAL, SEQ, embed.embedding_dim)
        for _ in range(scala["adv_steps"]):
            delta.requires_grad_(True)
            (g,) = torch.autograd.grad(loss_at(delta), delta)
            g = g * keep
            delta = delta.detach() + alpha * g / g.flatten(1).norm(dim=1)[:, None, None]
            n = delta.flatten(1).norm(dim=1)[:, None, None]
            delta = (delta * torch.clamp(eps / n, max=1.0)) * keep
        loss = loss_at(delta.detach())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    model.eval()
    probe = batch(99)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    return {"losses": losses, "params": dict(model.state_dict()), "logits": logits}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_scala_on_two_ranks_matches_plain_step_and_reference(stage: int) -> None:
    results = run_ranks(_rank_bound0, WORLD, args=(stage,), timeout=480)
    ref = reference(SCALA)
    for rank, r in enumerate(results):
        plain, zero, real = r["plain"], r["zero"], r["real"]
        assert zero["losses"] == plain["losses"], rank
        for name, value in plain["params"].items():
            assert torch.equal(zero["params"][name], value), (rank, name)
        assert torch.equal(zero["logits"], plain["logits"])
        assert max(zero["norms"]) == 0.0
        # the real noise: bounded, active, and the reference's training
        assert 0.0 < max(real["norms"]) <= SCALA["adv_max_norm"] * (1 + 1e-6)
        assert real["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        torch.testing.assert_close(real["logits"], ref["logits"], rtol=0, atol=1e-5)
        far = {
            n: float((real["params"][n] - p).abs().max())
            for n, p in ref["params"].items()
            if not n.endswith(NOISE_ONLY)
        }
        assert max(far.values()) <= 5e-5, sorted(far.items(), key=lambda kv: -kv[1])[:3]
    # the noise changed training (so the equalities above are not vacuous)
    assert results[0]["real"]["losses"] != results[0]["plain"]["losses"]


def _rank_decoder(rank: int, world: int) -> dict:
    return {
        "plain": _train(2, tiny_llama(), None, causal=True),
        "zero": _train(2, tiny_llama(), {**SCALA, "adv_max_norm": 0.0}, causal=True),
        "real": _train(2, tiny_llama(), {**SCALA, "adv_init_mag": 0.2}, causal=True),
    }


@pytest.mark.slow
def test_scala_on_a_causal_decoder_stage2() -> None:
    for r in run_ranks(_rank_decoder, WORLD, timeout=480):
        assert r["zero"]["losses"] == r["plain"]["losses"]
        for name, value in r["plain"]["params"].items():
            assert torch.equal(r["zero"]["params"][name], value), name
        assert 0.0 < max(r["real"]["norms"]) <= SCALA["adv_max_norm"] * (1 + 1e-6)
        assert r["real"]["losses"] != r["plain"]["losses"]
