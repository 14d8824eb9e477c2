"""Random-LTD's token routing against readable torch: gather/scatter and their gradients
equal the reference, masks and positions are cut per sample, and a routed layer of z train's
GPT, HF LLaMA and HF BERT computes, at the kept tokens, exactly the layer run on that
subsequence alone (with its true positions and the mask cut to it), and passes the dropped
tokens through unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from zcore.data_efficiency import token_routing as tr
from zcore.data_efficiency.random_ltd import RandomLTD, find_layers
from zcore.data_efficiency.random_ltd_config import RandomLTDConfig

B, T, C = 3, 12, 16


def ltd_config(
    layers: int, ids: list[int], keep: int, max_value: int = T, **extra: Any
) -> RandomLTDConfig:
    return RandomLTDConfig.model_validate(
        {
            "enabled": True,
            "total_layer_num": layers,
            "random_ltd_layer_num": len(ids),
            "random_ltd_layer_id": ids,
            "random_ltd_schedule": {
                "min_value": keep,
                "max_value": max_value,
                "schedule_config": {"require_steps": 100, "seq_per_step": 1},
            },
            **extra,
        }
    )


def test_sample_indices_are_sorted_distinct_and_in_range() -> None:
    idx = tr.sample_indices(64, T, 5, generator=torch.Generator().manual_seed(0))
    assert idx.shape == (64, 5) and idx.dtype == torch.int64
    assert bool((idx[:, 1:] > idx[:, :-1]).all()) and 0 <= int(idx.min()) <= int(idx.max()) < T
    assert len({tuple(r) for r in idx.tolist()}) > 1  # samples draw their own positions
    with pytest.raises(ValueError, match="keeps 13 of 12 tokens"):
        tr.sample_indices(1, T, T + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gather_scatter_equal_the_reference_values_and_grads(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    idx = tr.sample_indices(B, T, 5, generator=g)
    x = torch.randn(B, T, C, generator=g).to(dtype)
    w = torch.randn(B, T, C, generator=g).to(dtype)  # a loss weight, so every grad differs

    def run(gather: Any, scatter: Any) -> tuple[torch.Tensor, ...]:
        xi = x.clone().requires_grad_()
        part = gather(xi, idx)
        out = scatter(xi, part * 2 + 1, idx)
        (out * w).sum().backward()
        return part.detach(), out.detach(), xi.grad

    fast, ref = (
        run(tr.gather_tokens, tr.scatter_tokens),
        run(tr.gather_reference, tr.scatter_reference),
    )
    for a, b in zip(fast, ref, strict=True):
        assert torch.equal(a, b)  # copies: bit-exact
    part, out, _ = ref
    assert torch.equal(part[1], x[1, idx[1]])
    kept = torch.zeros(B, T, dtype=torch.bool).scatter_(1, idx, True)
    assert torch.equal(out[~kept], x[~kept])


def test_gather_mask_and_positions_index_per_sample() -> None:
    idx = tr.sample_indices(B, T, 4, generator=torch.Generator().manual_seed(2))
    causal = torch.randn(B, 1, T, T)
    padding = torch.randn(B, 1, 1, T)
    shared = torch.randn(1, 1, T, T)
    for b in range(B):
        i = idx[b]
        assert torch.equal(tr.gather_mask(causal, idx, T)[b, 0], causal[b, 0][i][:, i])
        assert torch.equal(tr.gather_mask(padding, idx, T)[b, 0, 0], padding[b, 0, 0, i])
        assert torch.equal(tr.gather_mask(shared, idx, T)[b, 0], shared[0, 0][i][:, i])
    pos = torch.arange(T).unsqueeze(0)  # (1, T), as HF passes it
    assert torch.equal(tr.gather_positions(pos, idx), idx)
    cos = torch.randn(1, T, 6)
    assert torch.equal(tr.gather_positions(cos, idx)[2], cos[0, idx[2]])


def _routed_output(
    layers: nn.ModuleList, ltd_id: int, keep: int, seed: int, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed layer's output and the positions it kept (redrawn from the same seed)."""
    torch.manual_seed(seed)
    out = layers[ltd_id](*args, **kwargs)
    torch.manual_seed(seed)
    x = args[0]
    return (out[0] if isinstance(out, tuple) else out), tr.sample_indices(
        x.shape[0], x.shape[1], keep
    )


def test_gpt_block_on_the_kept_tokens_equals_the_block_on_that_subsequence() -> None:
    from ztrain.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=50, n_layer=3, n_head=2, n_embd=C, block_size=T)).train()
    assert find_layers(model) is model.transformer.h
    x = torch.randn(B, T, C)
    plain = [model.transformer.h[1](x[b : b + 1]) for b in range(B)]
    ltd = RandomLTD.attach(model, ltd_config(3, [1], keep=5), global_batch_size=B)
    ltd.update(0)
    out, idx = _routed_output(model.transformer.h, 1, 5, 7, x)
    block = model.transformer.h[1]
    for b in range(B):
        sub = block.__class__.forward(block, x[b : b + 1, idx[b]])  # the block alone, causal
        torch.testing.assert_close(out[b, idx[b]], sub[0], rtol=1e-5, atol=1e-6)
        dropped = torch.ones(T, dtype=torch.bool)
        dropped[idx[b]] = False
        assert torch.equal(out[b, dropped], x[b, dropped])
    model.eval()  # eval: every token, the plain layer exactly
    assert all(torch.equal(model.transformer.h[1](x)[b], plain[b][0]) for b in range(B))
    ltd.detach()
    assert "forward" not in model.transformer.h[1].__dict__


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=C,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=T,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).train()


def test_llama_layer_keeps_true_positions_and_the_causal_mask_of_the_subset() -> None:
    model = _tiny_llama()
    layers, rotary = model.model.layers, model.model.rotary_emb
    x = torch.randn(B, T, C)
    pos = torch.arange(T).unsqueeze(0)
    neg = torch.finfo(torch.float32).min
    causal = torch.full((T, T), neg).triu(1).expand(B, 1, T, T)
    ltd = RandomLTD.attach(
        model, ltd_config(4, [1, 2], keep=6, model_mask_name="attention_mask"), B
    )
    ltd.update(0)
    out, idx = _routed_output(
        layers,
        1,
        6,
        3,
        x,
        attention_mask=causal,
        position_ids=pos,
        position_embeddings=rotary(x, pos),
    )
    layer = layers[1]
    for b in range(B):
        i = idx[b : b + 1]
        sub_mask = torch.full((6, 6), neg).triu(1).expand(1, 1, 6, 6)
        sub = layer.__class__.forward(
            layer,
            x[b : b + 1, i[0]],
            attention_mask=sub_mask,
            position_ids=i,
            position_embeddings=rotary(x, i),
        )
        sub = sub[0] if isinstance(sub, tuple) else sub
        torch.testing.assert_close(out[b, i[0]], sub[0], rtol=1e-5, atol=1e-6)
    # the whole model trains through the routed layers, and with keep = T equals plain
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(4))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and layers[1].self_attn.q_proj.weight.grad is not None
    ltd.detach()
    plain = model(input_ids=ids, labels=ids).loss
    full = RandomLTD.attach(
        model, ltd_config(4, [1, 2], keep=T, model_mask_name="attention_mask"), B
    )
    full.update(0)
    assert torch.equal(model(input_ids=ids, labels=ids).loss, plain)


def test_bert_layer_cuts_the_padding_mask_to_the_kept_tokens() -> None:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=64,
        hidden_size=C,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=T,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = BertModel(cfg).train()
    layers = model.encoder.layer
    assert find_layers(model) is layers
    x = torch.randn(B, T, C)
    mask = torch.zeros(B, 1, 1, T)
    mask[0, ..., -3:] = torch.finfo(torch.float32).min  # sample 0 is padded
    ltd = RandomLTD.attach(
        model, ltd_config(3, [1], keep=7, model_mask_name="attention_mask", model_type="encoder"), B
    )
    ltd.update(0)
    out, idx = _routed_output(layers, 1, 7, 5, x, mask)  # the mask positional, as BertEncoder
    layer = layers[1]
    for b in range(B):
        i = idx[b]
        sub = layer.__class__.forward(layer, x[b : b + 1, i], mask[b : b + 1, ..., i])
        sub = sub[0] if isinstance(sub, tuple) else sub
        torch.testing.assert_close(out[b, i], sub[0], rtol=1e-5, atol=1e-6)


def test_seq_batch_layout_routes_along_the_first_dim() -> None:
    class SeqFirst(nn.Module):  # (T, B, C) in and out: a running sum over the sequence
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h.cumsum(0)

    layers = nn.ModuleList([SeqFirst() for _ in range(3)]).train()
    ltd = RandomLTD(ltd_config(3, [1], keep=4, hidden_state_order="seq_batch_dim"), layers, B)
    ltd.update(0)
    x = torch.randn(T, B, C)
    torch.manual_seed(9)
    out = layers[1](x)
    torch.manual_seed(9)
    idx = tr.sample_indices(B, T, 4)
    for b in range(B):
        torch.testing.assert_close(out[idx[b], b], x[idx[b], b].cumsum(0))


def test_a_wrong_layer_count_and_a_model_without_layers_are_refused() -> None:
    model = _tiny_llama()
    with pytest.raises(ValueError, match="total_layer_num = 6: the model has 4 layers"):
        RandomLTD.attach(model, ltd_config(6, [1, 2], keep=4), B)
    with pytest.raises(ValueError, match="no layer list in Linear"):
        find_layers(nn.Linear(2, 2))
