"""ALST's tiling equals the untiled model: the loss over tiles of tokens (never the whole
``seq x vocab`` logits) and the MLP over tiles of positions give the same loss and gradients
as transformers' own forward, to fp32 summation order (1e-5 relative, 1e-6 absolute)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zcore.sequence.tiling import tile_causal_lm, tiled_loss


def _tiny() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=36,
        intermediate_size=48,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).train()


def _loss_and_grads(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("loss_tile", "mlp_tile"), [(5, 3), (64, None), (1, 1)])
def test_tiled_causal_lm_equals_the_untiled_one(loss_tile: int, mlp_tile: int | None) -> None:
    plain = _tiny()
    tiled = tile_causal_lm(copy.deepcopy(plain), loss_tile=loss_tile, mlp_tile=mlp_tile)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 13), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # unequal real tokens per row: the mean is over real tokens
    want_loss, want = _loss_and_grads(plain, ids, labels)
    got_loss, got = _loss_and_grads(tiled, ids, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_tiled_loss_keeps_one_tile_of_logits() -> None:
    head = nn.Linear(8, 1000, bias=False)
    hidden = torch.randn(1, 64, 8, requires_grad=True)
    labels = torch.randint(0, 1000, (1, 64))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = tiled_loss(hidden, head, labels, 64, tile_tokens=16)
    assert max(saved) < 64 * 1000  # no (64, 1000) logits kept for the backward
    loss.backward()
    want = nn.functional.cross_entropy(head(hidden[0]), labels[0])
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def test_a_model_that_is_not_llama_shaped_is_refused() -> None:
    with pytest.raises(ValueError, match="Sequential is not a LLaMA-family causal LM"):
        tile_causal_lm(nn.Sequential(nn.Linear(2, 2)))
