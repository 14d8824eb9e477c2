"""A Hugging Face LLaMA trained as pipeline stages saves under its own names: ``consolidate``
of the pp 2 checkpoint loads into ``LlamaForCausalLM`` (``strict=True``), and the plain model
under a data-parallel engine loads the checkpoint directly.

The pipeline is the model's own modules as layers (embedding, each decoder layer with its
rotary embedding and causal mask, the final norm, the untied head), its
``checkpoint_names()`` the Hugging Face names (:mod:`zcore.checkpoint.names`). Two gloo ranks
train it 2 steps at pp 2 (ZeRO-1, AdamW) and save; the consolidated tensors equal the
stages' parameters bit for bit, and so do the parameters of the plain model loaded by a
dp 2 engine.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.tensor.common import global_batch
from tests.zcore.tensor.test_llama_tp import make_llama
from tests.zcore.zero.common import config
from zcore.checkpoint import consolidate
from zcore.pipe import PipelineModule

LAYERS, GAS, ROWS = 2, 2, 4


class Embed(nn.Module):
    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class Decoder(nn.Module):
    """One decoder layer with what the model would hand it: rotary cos/sin, a causal mask."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        pos = torch.arange(t, device=h.device)[None]
        mask = torch.full((t, t), float("-inf"), device=h.device, dtype=h.dtype).triu(1)
        return self.layer(
            h, attention_mask=mask[None, None], position_embeddings=self.rotary(h, pos)
        )


def hf_name(name: str) -> str:
    idx, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", name).groups()  # type: ignore[union-attr]
    i = int(idx)
    if i == 0:
        return "model.embed_tokens." + rest.removeprefix("embed.")
    if i <= LAYERS:
        return f"model.layers.{i - 1}." + rest.removeprefix("layer.")
    return ("model.norm." if i == LAYERS + 1 else "lm_head.") + rest


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def pipelined_llama(stages: int) -> PipelineModule:
    hf = make_llama(tie_word_embeddings=False)
    body = hf.model
    layers = [Embed(body.embed_tokens), *(Decoder(d, body.rotary_emb) for d in body.layers)]
    model = PipelineModule([*layers, body.norm, hf.lm_head], stages, loss_fn=loss_fn)
    model.checkpoint_names = lambda: {n: hf_name(n) for n, _ in model.named_parameters()}
    return model


def _run(rank: int, world: int, root: str) -> dict[str, Any]:
    cfg = config(1, mb=ROWS // GAS, gas=GAS, clip=0.0, pipeline={"schedule": "1f1b"})
    engine, *_ = zcore.initialize(pipelined_llama(2), config=cfg)
    for step in range(2):
        x, y = global_batch(step, ROWS)
        micro = [(x[i : i + ROWS // GAS], y[i : i + ROWS // GAS]) for i in range(0, ROWS, 2)]
        engine.train_batch(iter(micro))
    engine.save_checkpoint(root, tag="pp2")
    mine = {hf_name(n): p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    plain, *_ = zcore.initialize(make_llama(tie_word_embeddings=False), config=config(1))
    plain.load_checkpoint(root, tag="pp2")
    loaded = {n: p.detach().clone() for n, p in plain.module.named_parameters()}
    plain.destroy()
    return {"mine": mine, "loaded": loaded}


@pytest.mark.slow(reason="2 ranks each import transformers' LLaMA and build two engines")
def test_a_pipelined_llama_checkpoint_loads_into_hugging_face(tmp_path: Path) -> None:
    outs = run_ranks(_run, 2, args=(str(tmp_path),), timeout=240)
    state = consolidate(str(tmp_path), "pp2")
    hf = make_llama(tie_word_embeddings=False)
    hf.load_state_dict(state, strict=True)
    for out in outs:
        for name, value in out["mine"].items():
            assert torch.equal(state[name], value), name
        assert out["loaded"].keys() == state.keys()
        for name, value in out["loaded"].items():
            assert torch.equal(value, state[name]), name
