"""Activation checkpoints kept in host memory (``zcore.sequence.offload``, ALST's third
piece): a tiny HF LLaMA with every decoder layer checkpointed that way gives the loss and
every gradient of the plain model bit for bit (one process); under ZeRO-3 with each
sequence split over cp=2 ranks, tiled, it trains like one process on the whole sequence
(``test_hf_ulysses``'s check: losses rtol 1e-5, weights 5e-5 over 10 steps; slow). On a CPU the
saved inputs are the tensors themselves (no copy); on CUDA (skipped without) they leave the
device between the passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.zcore.sequence.test_hf_ulysses import check, tiny
from zcore.sequence.offload import checkpoint_layers, host_checkpoint, keep_on_host


def _grads(model: nn.Module, ids: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def test_hf_layers_checkpointed_on_host_give_the_same_loss_and_gradients(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    path = tiny(tmp_path / "tiny")
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(1))
    plain = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    held = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    checkpoint_layers(held.model.layers, offload=True)
    loss, grads = _grads(plain, ids)
    loss_h, grads_h = _grads(held, ids)
    assert loss_h == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_h, strict=True))
    with pytest.raises(ValueError, match="checkpointed already"):
        checkpoint_layers(held.model.layers[:1])
    held.eval()
    with torch.no_grad():  # evaluation runs the layers as they are
        assert torch.equal(held(input_ids=ids).logits, plain.eval()(input_ids=ids).logits)


def test_on_cpu_the_saved_inputs_are_the_tensors_themselves() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    with keep_on_host():
        y = x @ w
    assert y.grad_fn._saved_self.data_ptr() == x.data_ptr()  # kept, not copied
    kw = torch.randn(4, 8, requires_grad=True)
    out = host_checkpoint(lambda a, *, b, scale: (a @ w + b) * scale, x, b=kw, scale=2.0)
    out.sum().backward()
    assert torch.equal(kw.grad, torch.full_like(kw, 2.0))  # a tensor keyword is an input


@pytest.mark.slow(reason="2 ranks x 10 steps of a HF model under ZeRO-3: 25-40 s on 2 cores")
def test_cp2_zero3_tiled_with_host_checkpoints_trains_like_one_process(tmp_path: Path) -> None:
    results = check(tmp_path, world=2, cp=2, tile=True, offload=True)
    assert [r["data"] for r in results] == [(1, 0), (1, 0)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device path needs CUDA")
def test_on_cuda_layer_inputs_leave_the_device_between_the_passes() -> None:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(256, 256), nn.GELU()).cuda() for _ in range(8)]
    x = torch.randn(64, 1024, 256, device="cuda", requires_grad=True)

    def run(offload: bool | None) -> tuple[int, list[torch.Tensor]]:
        for layer in layers:
            layer.__dict__.pop("forward", None)
            layer.__dict__.pop("_z_checkpointed", None)
            layer.zero_grad()
        if offload is not None:
            checkpoint_layers(layers, offload=offload)
        x.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        h = x
        for layer in layers:
            h = layer(h)
        held = torch.cuda.memory_allocated() - before
        h.sum().backward()
        return held, [x.grad.clone()] + [p.grad.clone() for m in layers for p in m.parameters()]

    plain_held, plain = run(None)
    device_held, on_device = run(False)
    host_held, on_host = run(True)
    one_input = x.numel() * x.element_size()
    assert device_held >= 7 * one_input  # every later layer's input stays on the device
    assert host_held <= 2 * one_input  # only the last output (and the input, not ours)
    assert host_held < device_held < plain_held
    for a, b, c in zip(plain, on_device, on_host, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
