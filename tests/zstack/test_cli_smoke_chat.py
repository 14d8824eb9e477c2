"""The smoke case of `z chat e2e` (registered into test_cli_smoke's CASES, which imports this
module; test_cli_smoke.py sits at its 500-line limit): SFT -> reward -> PPO on the tiny LLaMA,
1 rank, 1 step each, every stage's directory feeding the next, a PNG per stage."""

from __future__ import annotations

import json
from pathlib import Path

from tests.zstack.test_cli_smoke import Work, smoke


@smoke("chat e2e")
def _chat_e2e(w: Work) -> None:
    tiny = {"steps": 1, "micro_batch": 1, "train_examples": 2, "heldout_examples": 2}
    cfg = {"model": str(w.lm), "out": str(w.dir / "e2e"), "world": 1, "sft": tiny,
           "reward": tiny, "ppo": {"steps": 1, "prompts_per_rank": 1, "max_new_tokens": 3,
                                   "train_prompts": 2, "heldout_prompts": 2,
                                   "actor_lora_dim": 2, "critic_lora_dim": 2}}  # fmt: skip
    path = w.dir / "e2e.json"
    path.write_text(json.dumps(cfg))
    r = w.json("chat", "e2e", "--config", str(path), "--json")
    assert set(r["stage_wall_s"]) == {"sft", "reward", "ppo"}, r
    out = Path(r["out"])
    assert (out / "sft" / "config.json").is_file() and (out / "reward" / "config.json").is_file()
    assert (out / "ppo" / "actor" / "model.safetensors").is_file()
    for png in (out / "sft.metrics.png", out / "reward.metrics.png", out / "ppo" / "metrics.png"):
        assert png.stat().st_size > 0, png
    assert r["ppo_heldout_after"]["heldout_n"] == 2
