"""The smoke cases of `z chat` (registered into test_cli_smoke's CASES, which imports this
module): each stage on the tiny LLaMA, and `z chat e2e` (SFT -> reward -> PPO, 1 rank, 1 step
each, every stage's directory feeding the next, a PNG per stage)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.zstack.test_cli_smoke import Work, smoke


def _chat(stage: str, w: Work) -> None:  # tiny LLaMA, 1 rank, 1 step: trains, saves, plots
    r = w.json(
        "chat",
        stage,
        "--model",
        str(w.lm),
        "--out",
        str(w.dir / stage),
        "--nproc",
        "1",
        "--steps",
        "1",
        "--micro-batch",
        "1",
        "--train-examples",
        "2",
        "--heldout-examples",
        "2",
        "--json",
    )
    assert Path(r["plot"]).stat().st_size and r["final_loss"] > 0 and r["heldout_after"]


for _stage in ("sft", "reward", "dpo"):
    smoke(f"chat {_stage}")(lambda w, stage=_stage: _chat(stage, w))


def _rl(stage: str, w: Work) -> None:  # tiny LLaMA, 1 step of 1 prompt per rank
    from tests.zchat.test_ppo import tiny_reward_model

    # PPO runs in the command's own process (one rank: four models in two spawned ranks took
    # 34 s of the smoke lane); tests/zchat/test_ppo.py checks two ranks agreeing. GRPO keeps
    # the command's default of two spawned ranks, so the smoke lane still starts ranks.
    ppo = stage == "ppo"
    extra = ["--reward", str(tiny_reward_model(w.lm, w.dir / "rm")), "--nproc", "1"] if ppo else []
    r = w.json(
        "chat",
        stage,
        "--actor",
        str(w.lm),
        "--out",
        str(w.dir / stage),
        "--steps",
        "1",
        "--prompts-per-rank",
        "1",
        "--max-new-tokens",
        "3",
        "--train-prompts",
        "2",
        "--heldout-prompts",
        "2",
        "--json",
        *extra,
    )
    assert r["ranks"] == (1 if ppo else 2) and Path(r["metrics"]).is_file(), r


for _stage in ("ppo", "grpo"):
    smoke(f"chat {_stage}")(lambda w, stage=_stage: _rl(stage, w))


@smoke("chat e2e")
def _chat_e2e(w: Work) -> None:
    tiny = {"steps": 1, "micro_batch": 1, "train_examples": 2, "heldout_examples": 2}
    cfg = {
        "model": str(w.lm),
        "out": str(w.dir / "e2e"),
        "world": 1,
        "sft": tiny,
        "reward": {**tiny, "steps": 0, "warmup_blocks": 1, "warmup_epochs": 1},
        "ppo": {
            "steps": 1,
            "prompts_per_rank": 1,
            "max_new_tokens": 3,
            "train_prompts": 2,
            "heldout_prompts": 2,
            "actor_lora_dim": 2,
            "critic_lora_dim": 2,
        },
    }
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
