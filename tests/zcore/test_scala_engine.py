"""ScaLA through the zcore engine on 2 gloo ranks, ZeRO stages 0-2, against plain references
(the fast suite's version of test_scala_hf.py, on a small torch classifier shaped like an HF
encoder: ``get_input_embeddings()``, an attention mask, ``inputs_embeds``, dropout).

- *bound 0*: ``scala`` enabled with ``adv_max_norm`` 0 (2 ascent passes still run) trains
  bit for bit like the plain engine loop with dropout on: the ascent passes leave neither
  gradients nor a different RNG stream behind.
- *reference*: ScaLA (2 ascent steps, l2 ball, padded batches, gradient accumulation 2) on 2
  ranks trains like a readable single-process torch loop on the whole batch (PGA on
  ``inputs_embeds = embedding(ids) + delta`` written out from the definition, then torch
  AdamW). Tolerances (fp32): per-step losses rel 1e-5 (the ranks sum in another order),
  weights atol 2e-5.
- the perturbation stays within ``adv_max_norm`` and is nonzero; padding gets none.
- an HF BERT in this process (one rank) takes the same path: bound 0 equals the plain step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.utils.distributed import run_ranks

VOCAB, DIM, SEQ, LABELS = 53, 16, 10, 3
MB, GAS, WORLD, STEPS = 2, 2, 2, 3
GLOBAL = MB * GAS * WORLD
LR, WD = 3e-3, 0.01
SCALA = {"enabled": True, "adv_steps": 2, "adv_step_size": 0.3, "adv_max_norm": 0.5}


class TinyClassifier(nn.Module):
    """Token embedding + positions -> masked self-attention -> MLP -> masked mean -> head."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)
        self.attn = nn.MultiheadAttention(DIM, 2, bias=False, batch_first=True)
        self.ln = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 2 * DIM)
        self.proj = nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(DIM, LABELS)

    def get_input_embeddings(self) -> nn.Module:
        return self.tok

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = (self.tok(input_ids) if inputs_embeds is None else inputs_embeds) + self.pos
        a, _ = self.attn(x, x, x, key_padding_mask=attention_mask == 0, need_weights=False)
        x = self.ln(x + self.drop(a))
        x = x + self.drop(self.proj(F.gelu(self.fc(x))))
        keep = attention_mask[..., None].to(x.dtype)
        pooled = (x * keep).sum(1) / keep.sum(1)
        return F.cross_entropy(self.head(pooled), labels)


def make_model(dropout: float) -> TinyClassifier:
    torch.manual_seed(0)
    return TinyClassifier(dropout)


def batch(step: int) -> dict[str, torch.Tensor]:
    """The global batch of `step`: token ids, a right-padded attention mask, labels."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, VOCAB, (GLOBAL, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (GLOBAL,), generator=g)
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "labels": torch.randint(0, LABELS, (GLOBAL,), generator=g),
    }


def micro(step: int, m: int, rank: int, world: int, mb: int) -> dict[str, torch.Tensor]:
    i = (m * world + rank) * mb
    return {k: v[i : i + mb] for k, v in batch(step).items()}


def ds_config(stage: int, scala: dict[str, Any] | None, mb: int = MB) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        "comm_timeout_s": 60,
    }
    if scala is not None:
        cfg["scala"] = scala
    return cfg


def train(
    stage: int, model: nn.Module, scala: dict[str, Any] | None, mb: int = MB, loss_of: Any = None
) -> dict[str, Any]:
    """`STEPS` optimizer steps through `ScaLA.step`; losses (global mean), weights, delta norms."""
    import torch.distributed as dist

    import zcore
    import zcore.scala  # registers the `scala` block before the config is read
    from tests.zcore.zero.common import full_params

    engine, *_ = zcore.initialize(model, config=ds_config(stage, scala, mb))
    engine.train()
    runner = zcore.scala.ScaLA(engine)  # reads the config's `scala` block
    losses, norms, pad = [], [], 0.0
    for step in range(STEPS):
        total = torch.zeros(1)
        for m in range(GAS):
            b = micro(step, m, engine.rank, engine.world_size, mb)

            def loss_fn(b: dict[str, torch.Tensor] = b) -> torch.Tensor:
                return engine(**b) if loss_of is None else loss_of(engine, b)

            r = runner.step(loss_fn, mask=b["attention_mask"])
            total += r.loss
            norms.append(r.delta_norm)
            if runner.delta is not None:
                pad = max(pad, float(runner.delta[b["attention_mask"] == 0].abs().sum()))
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(float(total) / (GAS * engine.world_size))
    runner.close()
    return {"losses": losses, "params": full_params(engine), "norms": norms, "pad": pad}


def _ranks(rank: int, world: int) -> dict[int, dict[str, Any]]:
    torch.set_num_threads(1)  # tiny ops: 2 OpenMP threads per rank on 2 loaded cores ran 5x slower
    out = {}
    for stage in (0, 1, 2):
        out[stage] = {
            "plain": train(stage, make_model(0.1), None),
            "zero": train(stage, make_model(0.1), {**SCALA, "adv_max_norm": 0.0}),
            "real": train(stage, make_model(0.0), SCALA),
        }
    return out


def reference(scala: dict[str, Any]) -> dict[str, Any]:
    """One process, whole batch: PGA on the embedding output from its definition, then AdamW."""
    model = make_model(0.0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    eps, alpha = scala["adv_max_norm"], scala["adv_step_size"]
    losses = []
    for step in range(STEPS):
        b = batch(step)
        keep = b["attention_mask"][..., None].float()  # (B, T, 1)

        def loss_at(delta: torch.Tensor, b: dict[str, torch.Tensor] = b) -> torch.Tensor:
            return model(**b, inputs_embeds=model.tok(b["input_ids"]) + delta)

        delta = torch.zeros(GLOBAL, SEQ, DIM)
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
    return {"losses": losses, "params": dict(model.state_dict())}


def test_scala_on_two_ranks_stages_0_1_2_matches_plain_step_and_reference() -> None:
    results = run_ranks(_ranks, WORLD, timeout=180)
    ref = reference(SCALA)
    for rank, by_stage in enumerate(results):
        for stage, r in by_stage.items():
            plain, zero, real = r["plain"], r["zero"], r["real"]
            where = f"rank {rank} stage {stage}"
            assert zero["losses"] == plain["losses"], where
            for name, value in plain["params"].items():
                assert torch.equal(zero["params"][name], value), (where, name)
            assert max(zero["norms"]) == 0.0
            assert 0.0 < max(real["norms"]) <= SCALA["adv_max_norm"] * (1 + 1e-6), where
            assert real["pad"] == 0.0, where
            assert real["losses"] == pytest.approx(ref["losses"], rel=1e-5), where
            for name, value in ref["params"].items():
                torch.testing.assert_close(
                    real["params"][name], value, rtol=0, atol=2e-5, msg=f"{where} {name}"
                )
            assert real["losses"] != plain["losses"]  # the noise did change training


@pytest.fixture
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_hf_bert_in_process_bound_zero_is_the_plain_step(one_thread: Any) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    def bert() -> nn.Module:
        torch.manual_seed(0)
        return BertForSequenceClassification(
            BertConfig(
                vocab_size=VOCAB,
                hidden_size=DIM,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=24,
                max_position_embeddings=SEQ,
                num_labels=LABELS,
            )
        )

    def loss_of(engine: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return engine(**b).loss

    plain = train(0, bert(), None, mb=MB * WORLD, loss_of=loss_of)
    zero = train(0, bert(), {**SCALA, "adv_max_norm": 0.0}, mb=MB * WORLD, loss_of=loss_of)
    real = train(0, bert(), SCALA, mb=MB * WORLD, loss_of=loss_of)
    assert zero["losses"] == plain["losses"]
    for name, value in plain["params"].items():
        assert torch.equal(zero["params"][name], value), name
    assert 0.0 < max(real["norms"]) <= SCALA["adv_max_norm"] * (1 + 1e-6)
    assert real["pad"] == 0.0 and real["losses"] != plain["losses"]
