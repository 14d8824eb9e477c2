from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ztrain.gpt import GPT, PRESETS, Block, GPTConfig


def _formula(c: GPTConfig) -> int:
    d, b = c.n_embd, int(c.bias)
    per_layer = 12 * d * d + (13 * d if b else 2 * d)  # 4 Linear + 2 LayerNorm
    head = 0 if c.tie_weights else c.vocab_size * d
    return c.vocab_size * d + c.block_size * d + c.n_layer * per_layer + (2 if b else 1) * d + head


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_param_count_matches_formula(bias: bool, tie: bool) -> None:
    c = GPTConfig.preset("tiny", bias=bias, tie_weights=tie)
    model = GPT(c)
    assert model.num_params() == _formula(c) == c.num_params()


def test_preset_sizes() -> None:
    sizes = {name: GPTConfig.preset(name).num_params() for name in PRESETS}
    assert 0.8e6 < sizes["tiny"] < 1.5e6
    assert 5e6 < sizes["small"] < 8e6
    assert 26e6 < sizes["medium"] < 28e6


def test_tied_weights_share_one_parameter() -> None:
    tied = GPT(GPTConfig.preset("tiny"))
    assert tied.lm_head.weight is tied.transformer.wte.weight
    untied = GPT(GPTConfig.preset("tiny", tie_weights=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight


def test_parameters_live_in_leaf_modules() -> None:
    model = GPT(GPTConfig.preset("tiny"))
    for name, module in model.named_modules():
        if list(module.parameters(recurse=False)):
            assert isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)), name
    assert sum(isinstance(m, Block) for m in model.modules()) == 4


def test_init_is_deterministic_gpt2_style() -> None:
    c = GPTConfig.preset("tiny")
    a, b, other = GPT(c), GPT(c), GPT(c, seed=1)
    for (name, pa), pb, po in zip(
        a.state_dict().items(), b.state_dict().values(), other.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if name.endswith("c_attn.weight"):
            assert not torch.equal(pa, po)
    proj = a.transformer.h[0].attn.c_proj.weight
    assert abs(proj.std().item() - 0.02 / (2 * c.n_layer) ** 0.5) < 2e-3
    assert abs(a.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 2e-3
    assert torch.all(a.transformer.h[0].ln_1.weight == 1)


def test_forward_shapes_and_loss() -> None:
    c = GPTConfig.preset("tiny", vocab_size=300)
    model = GPT(c)
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 300, (2, 2, 16), generator=g)
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 16, 300)
    assert torch.allclose(loss, F.cross_entropy(logits.view(-1, 300), targets.view(-1)))
    # small init: close to uniform over the vocabulary
    assert abs(loss.item() - torch.log(torch.tensor(300.0)).item()) < 0.2
    assert model(idx)[1] is None
    with pytest.raises(ValueError, match="sequence length 129 > block_size 128"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_attention_is_causal() -> None:
    model = GPT(GPTConfig.preset("tiny", vocab_size=100)).eval()
    idx = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 100
    with torch.no_grad():
        a, b = model(idx)[0], model(changed)[0]
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_config_validation_and_json_round_trip() -> None:
    with pytest.raises(ValueError, match="n_embd 100 is not divisible by n_head 3"):
        GPTConfig(vocab_size=10, n_layer=1, n_head=3, n_embd=100, block_size=8)
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        GPTConfig.preset("huge")
    c = GPTConfig.preset("small", vocab_size=1000, dropout=0.1)
    assert GPTConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match=r"unknown GPTConfig fields \['n_kv'\]"):
        GPTConfig.from_dict({**dataclasses.asdict(c), "n_kv": 2})


def test_tiny_gpt_overfits_a_fixed_batch() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    idx = torch.randint(0, 2048, (4, 65), generator=torch.Generator().manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(50):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 10, losses[::10]
