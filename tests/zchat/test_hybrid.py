"""The hybrid engine on 2 gloo ranks with a ZeRO-3 actor (a tiny random LLaMA with SmolLM2's
tokenizer): its greedy rollouts equal transformers' ``generate`` on the same weights token for
token, its per-token logprobs equal the actor's own log-softmax (atol 1e-4), and after the
rollout the gathered weights are gone (no tensor left alive) and the actor's weight memory is
back to its ZeRO-3 level."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.distributed import run_ranks
from tests.utils.tiny_lm import write_tiny_lm

PROMPTS = [[1, 504, 3201, 28], [1, 77, 9, 4120, 881, 12, 3], [1, 9000], [1, 5, 6, 7, 8, 9]]
NEW = 8


def ds_config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
        "comm_timeout_s": 120,
    }


def _rank(rank: int, world: int, path: str) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    import zcore
    import zcore.hf
    from zchat.hybrid import HybridEngine, gather_full_weights
    from zchat.hybrid.gather import resident_param_bytes
    from zserve.sampling import SamplingParams

    model = zcore.hf.from_pretrained(LlamaForCausalLM, path, ds_config=ds_config())
    engine, *_ = zcore.initialize(model, config=ds_config())
    partitioned = [n for n, p in model.named_parameters() if p.data.numel() == 0]
    level = resident_param_bytes(model)
    hybrid = HybridEngine(engine)
    mine = PROMPTS[rank::world]
    gens, stats = hybrid.generate(mine, SamplingParams(max_tokens=NEW, temperature=0))
    # every tensor the gather produced is freed once the rollout is over
    refs = [weakref.ref(t) for t in gather_full_weights(model).values()]
    gc.collect()
    alive = sum(r() is not None for r in refs)
    sampled, _ = hybrid.generate(mine, SamplingParams(max_tokens=NEW, temperature=1.0, seed=3))
    # the sampled tokens' logprobs under the actor itself (ZeRO-3 forward)
    actor_lps = []
    with torch.no_grad():
        for g in sampled:
            ids = torch.tensor([g.prompt_ids + g.token_ids])
            logp = torch.log_softmax(engine(input_ids=ids).logits.float(), -1)[0]
            n = len(g.prompt_ids)
            rows = logp[n - 1 : n - 1 + len(g.token_ids)]
            actor_lps.append(rows.gather(1, torch.tensor(g.token_ids)[:, None])[:, 0])
    return {
        "tokens": [g.token_ids for g in gens],
        "stats": stats.as_dict(),
        "level": level,
        "level_after": resident_param_bytes(model),
        "partitioned": partitioned,
        "still_partitioned": all(model.get_parameter(n).data.numel() == 0 for n in partitioned),
        "alive": alive,
        "sampled_lps": [torch.tensor(g.logprobs) for g in sampled],
        "actor_lps": actor_lps,
    }


def hf_model(path: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_plain_actor_greedy_equals_hf_generate(tmp_path: Path) -> None:
    """One process, an unpartitioned actor: the weights are aliased, not gathered."""
    from zchat.hybrid import HybridEngine
    from zserve.sampling import SamplingParams

    path = write_tiny_lm(tmp_path / "tiny")
    hf = hf_model(path)
    gens, stats = HybridEngine(hf).generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0))
    for prompt, g in zip(PROMPTS, gens, strict=True):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
        assert g.token_ids == out[0, len(prompt) :].tolist(), prompt
    assert stats.generated_tokens == NEW * len(PROMPTS) and stats.forward_steps >= NEW
    assert stats.actor_bytes_before == stats.actor_bytes_after


@pytest.mark.slow
def test_greedy_rollout_equals_hf_generate_and_memory_is_released(tmp_path: Path) -> None:
    """2 ranks, ZeRO-3 (49 s here under load)."""
    path = write_tiny_lm(tmp_path / "tiny")
    results = run_ranks(_rank, 2, args=(str(path),), timeout=240)
    hf = hf_model(path)
    for rank, r in enumerate(results):
        for prompt, got in zip(PROMPTS[rank::2], r["tokens"], strict=True):
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=2
            )
            assert got == out[0, len(prompt) :].tolist(), (rank, prompt)
        s = r["stats"]
        assert "model.embed_tokens.weight" in r["partitioned"]
        assert r["still_partitioned"] and r["alive"] == 0
        assert s["actor_bytes_before"] == s["actor_bytes_after"] == r["level"] == r["level_after"]
        # zserve served the full weights: twice what each of the 2 ranks keeps (its shards)
        assert s["weights_bytes"] >= 1.9 * s["actor_bytes_before"]
        assert s["generated_tokens"] == NEW * len(PROMPTS[rank::2]) and s["tokens_per_s"] > 0
        for got, ref in zip(r["sampled_lps"], r["actor_lps"], strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
