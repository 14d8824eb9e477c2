"""Stage 3 after a no-grad forward that ran fewer modules than training does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import VOCAB, TinyLM, baseline, config, full_params, train


class SkippingLM(TinyLM):
    """TinyLM whose forward can skip its blocks (as an eval path that leaves modules out)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, skip: bool = False) -> torch.Tensor:
        x = self.emb(idx)
        if not skip:
            for b in self.blocks:
                x = b(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def _model() -> SkippingLM:
    torch.manual_seed(0)
    return SkippingLM()


EVAL = (torch.arange(16).view(2, 8) % VOCAB, (torch.arange(16).view(2, 8) * 7) % VOCAB)


def _train_eval_train(rank: int, world: int, zero: dict) -> dict:
    cfg = config(3, zero_optimization={"stage3_param_persistence_threshold": 0, **zero})
    engine, *_ = zcore.initialize(_model(), config=cfg)
    losses = train(engine, 1)
    engine.eval()
    with torch.no_grad():
        eval_loss = float(engine(*EVAL, skip=True))
    engine.train()
    losses += train(engine, 2, start=1)
    return {
        "eval": eval_loss,
        "losses": losses,
        "live": engine.stage3.live_elems,
        "params": full_params(engine),
    }


@pytest.mark.parametrize(
    "zero",
    [
        {},  # DeepSpeed's defaults: keep everything from forward to backward, prefetch
        {"stage3_max_reuse_distance": 2000, "stage3_prefetch_bucket_size": 0},
    ],
)
def test_training_after_a_shorter_eval_forward_matches_the_baseline(zero: dict) -> None:
    _, after_one = baseline(1, global_size=8, model=_model())
    probe = _model()
    probe.load_state_dict(after_one)
    with torch.no_grad():
        ref_eval = float(probe.eval()(*EVAL, skip=True))
    ref_losses, ref_params = baseline(3, global_size=8, model=_model())
    for r in run_ranks(_train_eval_train, 2, args=(zero,)):
        assert r["eval"] == pytest.approx(ref_eval, abs=2e-5)
        assert r["losses"] == pytest.approx(ref_losses, abs=2e-5)
        assert r["live"] == 0
        for name, value in ref_params.items():
            torch.testing.assert_close(r["params"][name], value, atol=1e-4, rtol=0, msg=name)
