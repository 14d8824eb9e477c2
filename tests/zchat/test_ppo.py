"""PPO end to end on a tiny random LLaMA (SmolLM2's tokenizer and chat template) and a reward
model built from it: the config refuses bad input naming the key; one process runs a step
and writes its metrics; 2 gloo ranks (slow) run steps whose metrics agree across ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.distributed import run_ranks
from tests.utils.tiny_lm import write_tiny_lm


def tiny_reward_model(lm: Path, out: Path) -> Path:
    """A reward model on ``lm``'s backbone with a fresh head (seed 0), saved to ``out``."""
    from zchat.data import load_tokenizer
    from zchat.reward import build_reward_model, save_reward_model

    rm = build_reward_model(lm, seed=0)
    return save_reward_model(rm, out, tokenizer=load_tokenizer(lm), source=lm)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ppo")
    actor = write_tiny_lm(root / "actor")
    return actor, tiny_reward_model(actor, root / "reward")


def config(dirs: tuple[Path, Path], out: Path, **kw: Any) -> Any:
    from zchat.ppo import PPOConfig

    base = dict(
        actor=dirs[0],
        reward=dirs[1],
        out=out,
        train_prompts=8,
        heldout_prompts=4,
        steps=1,
        prompts_per_rank=2,
        max_new_tokens=4,
        actor_lr=1e-3,
        critic_lr=1e-3,
    )
    return PPOConfig(**(base | kw))


def test_config_refuses_negative_kl_unknown_keys_and_missing_dirs(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"`kl_coef` -0.1 < 0 .*use a value >= 0"):
        config(dirs, tmp_path, kl_coef=-0.1)
    with pytest.raises(ValueError, match=r"kl_cof\n.*Extra inputs are not permitted"):
        config(dirs, tmp_path, kl_cof=0.1)
    with pytest.raises(ValueError, match=r"`cliprange` 1.5 must be < 1"):
        config(dirs, tmp_path, cliprange=1.5)
    with pytest.raises(ValueError, match=r"`steps` must be >= 1, got 0"):
        config(dirs, tmp_path, steps=0)
    with pytest.raises(ValueError, match=r"`reward` `.*nowhere` is not a model directory"):
        config((dirs[0], tmp_path / "nowhere"), tmp_path)
    assert config(dirs, tmp_path, kl_coef=0.0).kl_coef == 0.0


def test_sampled_heldout_answers_are_scored_with_fixed_seeds(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """``heldout_samples`` 3: 3 answers a prompt at the rollout temperature, scored like the
    greedy ones; the same numbers on a second evaluation and in a run with another ``seed``
    (fixed evaluation seeds), other answers than greedy decoding's."""
    from zchat.ppo.trainer import PPOTrainer

    one = PPOTrainer(config(dirs, tmp_path / "a", world=1, heldout_samples=3), 0, 1)
    first = one.evaluate()
    assert first["heldout_n"] == 4 and first["heldout_sampled_n"] == 12
    assert first == one.evaluate()
    other = PPOTrainer(config(dirs, tmp_path / "b", world=1, heldout_samples=3, seed=7), 0, 1)
    assert other.evaluate() == first
    assert first["heldout_sampled_reward"] != first["heldout_reward"]
    greedy = PPOTrainer(config(dirs, tmp_path / "c", world=1), 0, 1).evaluate()
    assert greedy == {k: v for k, v in first.items() if not k.startswith("heldout_sampled")}
    with pytest.raises(ValueError, match=r"`heldout_samples` must be >= 0"):
        config(dirs, tmp_path, heldout_samples=-1)


def test_one_process_step_writes_metrics_and_saves_the_actor(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from zchat.ppo.trainer import ppo_rank

    result = ppo_rank(0, 1, config(dirs, tmp_path / "out", world=1))
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("eval") for x in lines] == ["before", None, "after"]
    step = lines[1]
    for key in ("reward", "kl", "actor_loss", "critic_loss", "gen_tokens_per_s", "step_s"):
        assert isinstance(step[key], float) and step[key] == step[key], key  # not NaN
    assert abs(step["kl"]) < 1e-5  # the actor is the reference before its first update
    assert set(step["ranks"][0]["mem"]) >= {"rollout_gathered", "rollout_released", "train"}
    assert result["before"]["heldout_n"] == 4
    # the actor moved (lr 1e-3), and the saved one is what transformers loads
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "actor", dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(dirs[0], dtype=torch.float32)
    with torch.no_grad():
        moved = max(
            float((a - b).abs().max())
            for a, b in zip(saved.parameters(), start.parameters(), strict=True)
        )
    assert moved > 1e-4


def test_critic_warmup_steps_train_the_critic_alone(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """``critic_warmup_steps`` 1 of 2: step 1 steps the critic's optimizer only (and logs
    no policy loss for the frozen actor), step 2 both; a warm-up as long as the run is
    refused."""
    from zchat.ppo.trainer import PPOTrainer

    with pytest.raises(ValueError, match=r"`critic_warmup_steps` 2 >= `steps` 2: the actor"):
        config(dirs, tmp_path, steps=2, critic_warmup_steps=2)
    trainer = PPOTrainer(
        config(dirs, tmp_path / "w", world=1, steps=2, critic_warmup_steps=1), 0, 1
    )
    stepped: list[str] = []
    for name in ("actor", "critic"):
        engine = getattr(trainer, name)

        def counted(*a: Any, _real: Any = engine.step, _name: str = name, **k: Any) -> Any:
            stepped.append(_name)
            return _real(*a, **k)

        engine.step = counted
    warm = trainer.step(0)
    assert stepped == ["critic"]
    assert warm["actor_trained"] == 0 and warm["actor_loss"] == 0 and warm["clip_frac"] == 0
    trained = trainer.step(1)
    assert stepped == ["critic", "actor", "critic"]
    assert trained["actor_trained"] == 1


def _rank(rank: int, world: int, cfg: Any) -> list[dict[str, Any]]:
    from zchat.ppo.trainer import PPOTrainer

    trainer = PPOTrainer(cfg, rank, world)
    return [trainer.step(s) for s in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(900)  # 2 ranks loading transformers on a busy 2-core machine
def test_two_ranks_agree_on_the_step_metrics(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    cfg = config(dirs, tmp_path / "out", world=2)
    a, b = run_ranks(_rank, 2, args=(cfg,), timeout=800)
    for ma, mb in zip(a, b, strict=True):
        for key in ("reward", "kl", "actor_loss", "critic_loss"):
            assert ma[key] == mb[key], key  # means over ranks: the same on both
        assert len(ma["ranks"]) == 2
    assert abs(a[0]["kl"]) < 1e-5 and a[1]["kl"] != 0.0  # moved after the first update


LORA = dict(
    actor_lora_dim=2,
    critic_lora_dim=2,
    actor_lora_module_name="layers.",
    critic_lora_module_name="layers.",
    only_optimize_lora=True,
    actor_lora_learning_rate=1e-2,
    critic_lora_learning_rate=1e-2,
)


def test_lora_keys_are_checked_before_the_ranks_start(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    from zchat.ppo.trainer import prepare_ppo

    with pytest.raises(ValueError, match=r"`only_optimize_lora` needs LoRA"):
        config(dirs, tmp_path, only_optimize_lora=True)
    with pytest.raises(ValueError, match=r"`actor_lora_dim` must be >= 0"):
        config(dirs, tmp_path, actor_lora_dim=-1)
    bad = config(dirs, tmp_path, **(LORA | {"critic_lora_module_name": "decoder.layers."}))
    with pytest.raises(
        ValueError,
        match=r"`critic_lora_module_name` 'decoder.layers.' matches "
        r"no nn.Linear.*use 'layers.'",
    ):
        prepare_ppo(bad)
    prepare_ppo(config(dirs, tmp_path, **LORA))


def test_one_process_lora_step_uses_the_actor_as_reference_and_saves_merged(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from zchat.ppo.trainer import PPOTrainer

    cfg = config(dirs, tmp_path / "out", world=1, steps=2, **LORA)
    trainer = PPOTrainer(cfg, 0, 1)
    assert trainer.ref is None  # LoRA off is the reference
    trainable = [n for n, p in trainer.actor.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    critic = [n for n, p in trainer.critic.module.named_parameters() if p.requires_grad]
    assert "rm.v_head.weight" in critic and all("lora_" in n or "v_head" in n for n in critic)
    trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "eval" not in x]
    assert steps[0]["kl"] == 0.0  # the LoRA left matrices start at zero: actor == reference
    assert steps[1]["kl"] != 0.0  # and moved after the first update
    saved = tmp_path / "out" / "actor"
    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        assert not any("lora_" in k for k in f.keys())  # merged back to plain linears
    after = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
    start = AutoModelForCausalLM.from_pretrained(dirs[0], dtype=torch.float32).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert float((after[q] - start[q]).abs().max()) > 1e-6
    emb = "model.embed_tokens.weight"  # frozen: not a LoRA layer, unchanged
    assert torch.equal(after[emb], start[emb])
