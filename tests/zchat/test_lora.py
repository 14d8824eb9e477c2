"""zchat.lora (DeepSpeed-Chat's LoRA): a converted layer equals the plain linear at init and,
merged, after its LoRA matrices moved; the rollout gather serves the merged weights; LoRA-only
training on 2 ZeRO-3 ranks (slow) equals one process with torch's AdamW on the same groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.utils.distributed import run_ranks
from tests.utils.tiny_lm import write_tiny_lm


def _moved(layer: nn.Module, seed: int = 1) -> None:
    """Give a LoRA layer non-zero left weights (as training would)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.lora_left_weight.copy_(torch.randn(layer.lora_left_weight.shape, generator=g))


def test_lora_linear_equals_plain_linear_at_init_and_merged_after_moving() -> None:
    from zchat.lora import LoRALinear, merged_weight

    torch.manual_seed(0)
    plain = nn.Linear(24, 16)
    x = torch.randn(3, 5, 24)
    layer = LoRALinear(plain, lora_dim=4)
    assert layer.weight is plain.weight and layer.bias is plain.bias  # no copy
    assert torch.equal(layer(x), plain(x))  # left matrix zero: exactly the linear
    _moved(layer)
    out = layer(x)
    assert not torch.allclose(out, plain(x), atol=1e-3)
    merged = F.linear(x, merged_weight(layer), layer.bias)
    torch.testing.assert_close(merged, out, rtol=1e-5, atol=1e-5)  # fp32 reassociation
    assert layer.lora_scaling == 1.0 / 4  # DeepSpeed-Chat: lora_scaling / lora_dim


def test_convert_merge_and_the_rollout_gather_on_a_llama(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from zchat.hybrid import gather_full_weights
    from zchat.lora import convert_to_lora, lora_modules, merge_lora_, only_optimize_lora_

    lm = write_tiny_lm(tmp_path / "lm")
    model = AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (2, 7))
    with torch.no_grad():
        base = model(input_ids=ids).logits
    with pytest.raises(
        ValueError,
        match=r"`actor_lora_module_name` 'decoder.layers.' matches "
        r"no nn.Linear.*use 'layers.'",
    ):
        convert_to_lora(model, "decoder.layers.", 4, key="actor_lora_module_name")
    names = convert_to_lora(model, "layers.", 4)
    assert len(names) == 2 * 7 and "lm_head" not in names  # q k v o gate up down per layer
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base)
    trainable = only_optimize_lora_(model)
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    for i, layer in enumerate(lora_modules(model).values()):
        _moved(layer, seed=i)
    with torch.no_grad():
        moved = model(input_ids=ids).logits
    weights = gather_full_weights(model)  # served: merged, under the plain names
    assert not any("lora_" in n for n in weights)
    assert set(weights) == {
        n
        for n, _ in AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32).named_parameters()
    }
    q = lora_modules(model)["model.layers.0.self_attn.q_proj"]
    torch.testing.assert_close(
        weights["model.layers.0.self_attn.q_proj.weight"], q.weight + q.delta()
    )
    assert merge_lora_(model) == 14 and not lora_modules(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, moved, rtol=1e-4, atol=1e-4)


def _lora_train(rank: int, world: int, lm: Path, zero: bool) -> tuple[list[float], dict]:
    """4 steps of LoRA-only training (rank 4, lr 1e-2) of ``lm`` on a fixed batch: ZeRO-3 on
    ``world`` ranks (each rank half the batch) or one process with torch's AdamW."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import zcore
    import zcore.hf
    from zchat.hybrid import gather_full_weights
    from zchat.ppo.models import lora_param_groups

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (4, 9), generator=torch.Generator().manual_seed(3))
    ds = {
        "train_micro_batch_size_per_gpu": 4 // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.0},
        },
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if zero:
        hf = AutoConfig.from_pretrained(lm)
        model = zcore.hf.from_pretrained(AutoModelForCausalLM, lm, ds_config=ds, config=hf)
    else:
        model = AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32)
    groups = lora_param_groups(model, 4, "layers.", "k", True, 1e-2)
    if zero:
        engine, *_ = zcore.initialize(model, model_parameters=groups, config=ds)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    mine = ids[rank * (4 // world) : (rank + 1) * (4 // world)]
    losses = []
    for _ in range(4):
        if zero:
            loss = engine(input_ids=mine, labels=mine).loss  # this rank's half
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        else:
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    target = engine.module if zero else model
    return losses, {k: v.clone() for k, v in gather_full_weights(target).items()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_only_zero3_two_ranks_equals_one_process_adamw(tmp_path: Path) -> None:
    lm = write_tiny_lm(tmp_path / "lm")
    ref_losses, ref_w = _lora_train(0, 1, lm, zero=False)
    (a_losses, a_w), (b_losses, _) = run_ranks(_lora_train, 2, args=(lm, True), timeout=600)
    # the mean of the two halves' mean losses is the full batch's mean (equal lengths)
    both = (torch.tensor(a_losses) + torch.tensor(b_losses)) / 2
    torch.testing.assert_close(both, torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    assert ref_losses[-1] < ref_losses[0]
    for name, w in ref_w.items():  # the served (merged) weights after 4 steps
        torch.testing.assert_close(a_w[name], w, rtol=1e-4, atol=1e-5, msg=name)
