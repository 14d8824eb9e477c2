"""The Mixtral-architecture LM of `z train --moe` against transformers' MixtralForCausalLM.

No training here (`tests/zstack/test_train_moe.py` runs the recipe): random weights, the
Mixtral export (`mixtral_export.py`) read back by transformers, and the logits compared on
real text. Tolerance: fp32, max |logit difference| <= 1e-4 x max(1, max |logit|), as
zserve's Mixtral tests (measured ~1e-6: only summation order differs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import MixtralForCausalLM

from ztrain.data import ShakespeareData
from ztrain.mixtral_export import ExportError, check_exportable, export_mixtral
from ztrain.moe_lm import MoELM, MoELMConfig, layer_experts, swiglu_ffn
from ztrain.tokenizer import Tokenizer


def config(vocab: int, **overrides: object) -> MoELMConfig:
    base: dict[str, object] = dict(
        vocab_size=vocab,
        n_layer=2,
        n_head=4,
        n_embd=64,
        block_size=128,
        expert_ffn=48,
        experts=(4, 4),
        k=2,
        dropless=True,
    )
    return MoELMConfig(**{**base, **overrides})  # type: ignore[arg-type]


def random_model(c: MoELMConfig, seed: int = 1) -> MoELM:
    """Weights spread wider than the init, so routing and every expert matter."""
    model = MoELM(c, seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    diff = (out - ref).abs().max().item()
    assert diff <= 1e-4 * max(1.0, ref.abs().max().item()), f"{what}: max |logit diff| {diff:.2e}"


@pytest.fixture(scope="module")
def text_ids(data: ShakespeareData) -> torch.Tensor:
    """(2, 96) windows of the held-out plays."""
    return data.stream("val", 96).get_micro_batch(0, 0, 0, 1, 2)[0]


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # top-2 dropless (zmoe's top2 path)
        {"k": 3},  # zmoe's top-k path
        {"dropless": False, "capacity_factor": 8.0},  # capacity path, nothing dropped
    ],
    ids=["top2-dropless", "top3", "capacity"],
)
def test_logits_equal_transformers_mixtral(
    tokenizer: Tokenizer, text_ids: torch.Tensor, tmp_path: Path, overrides: dict[str, object]
) -> None:
    c = config(tokenizer.vocab_size, **overrides)
    model = random_model(c)
    out = export_mixtral(model.state_dict(), c, tokenizer, tmp_path / "mixtral")
    hf = MixtralForCausalLM.from_pretrained(out).eval()
    assert hf.config.num_local_experts == 4 and hf.config.num_experts_per_tok == c.k
    with torch.no_grad():
        ours, ref = model(text_ids)[0], hf(text_ids).logits
    assert_close(ours, ref, str(overrides))


def test_dense_twin_has_the_active_parameters() -> None:
    moe = config(300, experts=(8, 8), expert_ffn=swiglu_ffn(64, 2))
    twin = dataclasses.replace(moe, experts=(0, 0))
    router = 2 * 8 * 64
    assert moe.num_params(active=True) - router == twin.num_params() == MoELM(twin).num_params()
    assert moe.num_params() == MoELM(moe).num_params()
    assert {n for n, _ in MoELM(twin).named_parameters() if ".mlp." in n} == {
        f"model.layers.{i}.mlp.w{w}.weight" for i in range(2) for w in "123"
    }


def test_training_loss_adds_the_aux_loss() -> None:
    model = MoELM(config(300, aux_loss_coef=0.5))
    x = torch.randint(0, 300, (2, 16))
    _, loss = model(x, x)
    aux = sum(layer.last_stats.aux_loss for layer in model.moe_layers())
    assert loss.item() == pytest.approx(model.last_ce + 0.5 * float(aux), rel=1e-5)
    model.eval()
    assert model(x, x)[1].item() == pytest.approx(model.last_ce)


def test_layer_patterns_and_pyramid() -> None:
    assert layer_experts(4, "every", (8,)) == (8, 8, 8, 8)
    assert layer_experts(6, "every-other", (4,)) == (0, 4, 0, 4, 0, 4)
    assert layer_experts(4, "every", (4, 8)) == (4, 4, 8, 8)
    with pytest.raises(ValueError, match=r"2 expert counts \[4, 8\] do not split the 3 MoE"):
        layer_experts(6, "every-other", (4, 8))
    with pytest.raises(ValueError, match=r"'odd' is not one of"):
        layer_experts(6, "odd", (4,))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"experts": (0, 4)}, r"layers \[0\] are dense"),
        ({"experts": (4, 8)}, r"different expert counts \[4, 8\]"),
        ({"k": 1}, r"top-k 1: Mixtral renormalises"),
        ({"router": "sigmoid"}, r"router 'sigmoid'"),
        ({"use_residual": True}, r"residual MoE"),
        ({"aux_loss_free_bias": True}, r"aux-loss-free routing bias"),
    ],
)
def test_export_refuses_what_mixtral_cannot_hold(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ExportError, match=message):
        check_exportable(config(300, **overrides))
