"""A Hugging Face LLaMA at cp2 x tp2 (4 ranks) trains as one process does on the whole sequence.

The composition a user writes: the model built by transformers (outside ``zcore.zero.Init``:
tensor parallelism cuts whole weights), cut by the ``llama`` tensor-parallel plan over the
mesh's ``tp`` axis, then :func:`zcore.sequence.hf.parallelize` over its ``cp`` axis, then the
ZeRO engine (stage 3 partitions the shards when it starts). The heads are split over
``tp x cp``: 4 query heads become 2 a ``tp`` rank and 1 a rank after Ulysses' all-to-all; the
2 key/value heads become 1 a ``tp`` rank, fewer than ``cp``, so Ulysses replicates it. The
length (11) is not divisible by cp.

Ten AdamW steps with clipping on one batch against transformers' own model and torch AdamW in one process
(``test_hf_ulysses.baseline``): per-step losses rtol 1e-5, every gathered parameter within
5e-5 (the tolerances of ``test_hf_ulysses``; measured 2.2e-7 at 6 steps).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.utils.distributed import run_ranks
from tests.zcore.sequence.test_hf_ulysses import baseline, batches, ds_config

HEADS = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
MB = 2


def _rank(rank: int, world: int, path: str, data: list, stage: int) -> dict:
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import zcore
    from zcore.comm import MeshSpec
    from zcore.sequence.hf import parallelize as split_sequences
    from zcore.tensor import gather_full_state_dict, parallelize

    spec = MeshSpec.resolve(world, tp=2, cp=2)
    cfg = ds_config(2, MB)
    cfg["zero_optimization"]["stage"] = stage
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    parallelize(model, spec)
    engine, *_ = zcore.initialize(model, config=cfg, mesh=spec)
    split_sequences(engine.module, engine.mesh)
    engine.train()
    losses = []
    for batch in data:
        loss = engine(input_ids=batch[:MB], labels=batch[:MB]).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every rank holds the whole sequence's loss
        losses.append(float(total) / world)
    params = gather_full_state_dict(engine.module)
    return {"losses": losses, "params": params, "data": engine.data_rank}


@pytest.mark.slow(reason="4 ranks x 10 steps of a HF model at each stage: ~1 min on 2 cores")
@pytest.mark.parametrize("stage", [1, 3])
def test_cp2_tp2_trains_like_one_process_on_the_whole_sequence(stage: int, tmp_path: Path) -> None:
    from tests.zserve.tiny_llama import tiny_llama

    src = tmp_path / "tiny"
    tiny_llama(src, intermediate_size=48, **HEADS)
    data = batches(MB, steps=1) * 10  # one batch, learnt: the loss must fall
    results = run_ranks(_rank, 4, args=(str(src), data, stage), timeout=600)
    ref_losses, ref = baseline(src, data)
    assert ref_losses[-1] < ref_losses[0]  # it did train
    want = dict(ref.named_parameters())
    for r in results:
        assert r["data"] == 0  # the cp and tp ranks all read the one data rank's batch
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), (r["losses"], ref_losses)
        far = {k: float((v - want[k].detach()).abs().max()) for k, v in r["params"].items()}
        assert set(far) == set(want)
        assert max(far.values()) <= 5e-5, sorted(far.items(), key=lambda kv: -kv[1])[:5]
