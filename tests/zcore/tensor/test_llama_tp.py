"""A Hugging Face ``LlamaForCausalLM`` at tp 2 trains as it does on one process.

A random 2-layer LLaMA (4 query heads, 2 key/value heads, tied embeddings, as small
LLaMA-family checkpoints have), and a Qwen2 of the same shape (biases on q, k and v), are
cut by the ``llama`` plan, chosen from their ``config.model_type``; Hugging Face's own loss runs on the gathered logits. Ten AdamW steps
under the ZeRO engine with clipping must give the single-process run's losses (1e-5
relative), clipped norms (1e-4) and parameters (2e-5 absolute); the tp 2 checkpoint,
consolidated, loads into the plain Hugging Face model (``strict=True``) with those values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.tensor.common import assert_same_run, global_batch
from tests.zcore.zero.common import config
from zcore.checkpoint import consolidate
from zcore.comm import MeshSpec
from zcore.tensor import gather_full_state_dict, parallelize, plan_for

STEPS, MB = 10, 2


def make_llama(family: str = "llama", **overrides: object) -> torch.nn.Module:
    import transformers

    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[family]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    shape = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return model_cls(config_cls(**{**shape, **overrides}))


def _run(rank: int, world: int, family: str, root: str) -> dict:
    spec = MeshSpec.resolve(world, tp=world)
    model = make_llama(family)
    if world > 1:
        assert plan_for(model).name == "llama"
        model = parallelize(model, spec)
    engine, *_ = zcore.initialize(model, config=config(1, mb=MB, gas=1, clip=0.05), mesh=spec)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = global_batch(step, MB)
        loss = engine(input_ids=x, labels=y).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    out = {"losses": losses, "norms": norms, "params": gather_full_state_dict(engine.module)}
    engine.save_checkpoint(root, tag="t")
    engine.destroy()
    fresh = make_llama(family)  # the checkpoint consolidated loads into the plain HF model
    fresh.load_state_dict(consolidate(root, "t"), strict=True)
    full = fresh.state_dict()
    out["loads"] = all(torch.equal(full[k], v) for k, v in out["params"].items())
    return out


@pytest.mark.slow(reason="3 ranks each import transformers' LLaMA (~20 s on 2 cores)")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_family_tp2_equals_single_process(family: str, tmp_path: Path) -> None:
    (ref,) = run_ranks(_run, 1, args=(family, str(tmp_path / "one")))
    for rank, out in enumerate(run_ranks(_run, 2, args=(family, str(tmp_path / "tp")))):
        assert_same_run(out, ref, f"tp rank {rank}")
        assert out["loads"], rank
