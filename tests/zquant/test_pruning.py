"""Pruning on all-MiniLM-L6-v2 (real weights, real Shakespeare sentences).

MiniLM: 6 layers, hidden 384, 12 heads of 32, FFN 1536. Per layer the FFN holds
intermediate.dense 1536x384 (+1536 bias) and output.dense 384x1536 (+384 bias); the attention
q/k/v/output are 384x384 (+384 bias each).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.zquant.compress_utils import encode, minilm, pooled, shakespeare_sentences
from zquant.clean import count_parameters, redundancy_clean
from zquant.pruning import (
    mask_of,
    prune_channels,
    prune_heads,
    prune_nm,
    prune_rows,
    prune_sparse,
    sparsity,
)

torch.manual_seed(0)
LAYERS = 6


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    return encode(shakespeare_sentences()[:24])


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(model.encoder.layer)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.encoder.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_unstructured_keeps_dense_ratio_through_training(method: str, batch) -> None:
    model = minilm()
    for linear in _linears(model):
        prune_sparse(linear, dense_ratio=0.3, method=method)
    for linear in _linears(model):
        # round(numel * 0.3) weights stay, so within one weight of 70%
        assert sparsity(linear) == pytest.approx(0.7, abs=1.0 / linear.weight.numel())
    # The mask is a parametrization, so an optimizer step on the originals keeps the zeros.
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    pooled(model, batch).pow(2).mean().backward()
    opt.step()
    model.eval()
    for linear in _linears(model):
        assert sparsity(linear) == pytest.approx(0.7, abs=1.0 / linear.weight.numel())
    if method == "l1":  # fixed mask: exactly the smallest |w| are gone
        w = mask_of(model.encoder.layer[0].attention.self.query)
        assert w is not None and float(w.mask.mean()) == pytest.approx(
            0.3, abs=1.0 / w.mask.numel()
        )


def test_two_four_masks_have_two_nonzeros_per_four(batch) -> None:
    model = minilm()
    with torch.no_grad():
        reference = pooled(model, batch)
    for linear in _linears(model):
        prune_nm(linear, 2, 4)
    for linear in _linears(model):
        groups = (linear.weight != 0).view(linear.out_features, -1, 4).sum(-1)
        assert bool((groups == 2).all()), linear
    with torch.no_grad():
        cos = torch.cosine_similarity(pooled(model, batch), reference, dim=-1).mean()
    assert float(cos) > 0.5  # 2:4 by magnitude without retraining still resembles the model


def _masked_and_cleaned(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(masked output, cleaned output, parameters before, after), computed in float64.

    float64 separates structure from rounding: in fp32 a 6-head attention sums its output
    projection in a different order than the 12-head masked one (max |diff| 1.9e-5 on outputs
    of magnitude 6); in float64 the two agree to 1e-12, far inside the 1e-5 asked for.
    """
    model.to(torch.float64)
    with torch.no_grad():
        masked = model(**batch).last_hidden_state
    before = count_parameters(model)
    redundancy_clean(model)
    after = count_parameters(model)
    with torch.no_grad():
        cleaned = model(**batch).last_hidden_state
    return masked, cleaned, before, after


@pytest.mark.parametrize("method", ["l1", "l2"])
def test_row_pruning_clean_halves_the_ffn(method: str, batch) -> None:
    model = minilm()
    for layer in _layers(model):
        prune_rows(layer.intermediate.dense, dense_ratio=0.5, method=method)
    masked, cleaned, before, after = _masked_and_cleaned(model, batch)
    # Per layer 768 of 1536 rows go: 768*384 (intermediate weight) + 768 (its bias)
    # + 384*768 (output.dense's matching input columns) = 590,592 parameters.
    assert before - after == LAYERS * (768 * 384 + 768 + 384 * 768) == 3_543_552
    for layer in _layers(model):
        assert layer.intermediate.dense.weight.shape == (768, 384)
        assert layer.output.dense.weight.shape == (384, 768)
        assert mask_of(layer.intermediate.dense) is None
    assert torch.allclose(cleaned, masked, atol=1e-10, rtol=0)


def test_channel_pruning_clean_shrinks_the_producer(batch) -> None:
    model = minilm()
    for layer in _layers(model):
        prune_channels(layer.output.dense, dense_ratio=0.25)
    masked, cleaned, before, after = _masked_and_cleaned(model, batch)
    # 1152 of 1536 FFN channels go per layer: output.dense columns 384*1152, intermediate rows
    # 1152*384 and their bias 1152.
    assert before - after == LAYERS * (2 * 384 * 1152 + 1152)
    assert model.encoder.layer[0].intermediate.dense.out_features == 384
    assert torch.allclose(cleaned, masked, atol=1e-10, rtol=0)


def test_head_pruning_clean_shrinks_attention(batch) -> None:
    model = minilm()
    for layer in _layers(model):
        prune_heads(layer.attention.output.dense, num_heads=12, dense_ratio=0.5)
    masked, cleaned, before, after = _masked_and_cleaned(model, batch)
    # 6 of 12 heads (12*32 = 384 -> 192 wide) go per layer: q/k/v lose 192 rows + 192 bias each,
    # the output projection 192 input columns: 3*(192*384 + 192) + 384*192 = 295,488.
    assert before - after == LAYERS * (3 * (192 * 384 + 192) + 384 * 192) == 1_772_928
    attn = model.encoder.layer[0].attention.self
    assert attn.num_attention_heads == 6 and attn.all_head_size == 384 // 2
    assert attn.query.weight.shape == (192, 384)
    assert torch.allclose(cleaned, masked, atol=1e-10, rtol=0)


def test_row_and_head_pruning_compose_then_clean(batch) -> None:
    """All structured kinds at once: the attention loses 1/4 of heads, the FFN 3/4 of rows."""
    model = minilm()
    total = count_parameters(model)
    for layer in _layers(model):
        prune_heads(layer.attention.output.dense, num_heads=12, dense_ratio=0.75, method="topk")
        prune_rows(layer.intermediate.dense, dense_ratio=0.25)
    masked, cleaned, before, after = _masked_and_cleaned(model, batch)
    assert before == total
    # 3 of 12 heads (96 columns) and 1152 of 1536 FFN rows go per layer.
    heads = 3 * (96 * 384 + 96) + 384 * 96
    rows = 1152 * 384 + 1152 + 384 * 1152
    assert before - after == LAYERS * (heads + rows) == 6_201_792
    assert model.encoder.layer[5].attention.self.num_attention_heads == 9
    assert torch.allclose(cleaned, masked, atol=1e-10, rtol=0)


def test_bad_inputs_name_the_problem() -> None:
    layer = nn.Linear(10, 6)
    with pytest.raises(ValueError, match="dense_ratio"):
        prune_rows(layer, dense_ratio=1.5)
    with pytest.raises(ValueError, match="not divisible by m=4"):
        prune_nm(nn.Linear(10, 4), 2, 4)
    with pytest.raises(ValueError, match="num_heads 5"):
        prune_heads(nn.Linear(12, 12), num_heads=5, dense_ratio=0.5)
    with pytest.raises(TypeError, match="LayerNorm"):
        prune_rows(nn.LayerNorm(4), dense_ratio=0.5)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    prune_rows(model[0], dense_ratio=0.5)
    with pytest.raises(ValueError, match="no consumer layer known"):
        redundancy_clean(model)
    mask_of(model[0]).related = ["2"]  # the explicit consumer makes it cleanable
    x = torch.randn(5, 4)
    with torch.no_grad():
        masked = model(x)
        redundancy_clean(model)
        assert model[2].in_features == 4
        assert torch.allclose(model(x), masked, atol=1e-6)
