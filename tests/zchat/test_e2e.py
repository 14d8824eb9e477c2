"""zchat.e2e's config: each stage reads the one before, and a bad key in any stage's block
fails at start naming the stage and the key (before the SFT stage would run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils.tiny_lm import write_tiny_lm


def test_stages_chain_their_directories_and_bad_blocks_fail_at_start(tmp_path: Path) -> None:
    from zchat.config import ChatConfigError, load_config
    from zchat.e2e import E2EConfig

    lm = write_tiny_lm(tmp_path / "lm")
    cfg = load_config(
        E2EConfig, {"model": str(lm), "out": str(tmp_path / "e2e"), "ppo": {"steps": 3}}
    )
    cfg.check_stages()
    sft, rm, ppo = (cfg.stage_dict(s) for s in ("sft", "reward", "ppo"))
    assert sft["model"] == str(lm) and rm["model"] == sft["out"]
    assert ppo["actor"] == sft["out"] and ppo["reward"] == rm["out"] and ppo["steps"] == 3
    assert ppo["only_optimize_lora"] and ppo["actor_lora_module_name"] == "layers."
    with pytest.raises(ChatConfigError, match=r"e2e block `ppo`: .*unknown key `kl_cof`"):
        load_config(E2EConfig, {"model": str(lm), "ppo": {"kl_cof": 0.1}}).check_stages()
    with pytest.raises(ChatConfigError, match=r"e2e block `ppo`: .*`kl_coef` -1.* >= 0"):
        load_config(E2EConfig, {"model": str(lm), "ppo": {"kl_coef": -1}}).check_stages()
    with pytest.raises(ChatConfigError, match=r"e2e block `sft`: .*`steps` must be"):
        load_config(E2EConfig, {"model": str(lm), "sft": {"steps": 0}}).check_stages()
    with pytest.raises(ChatConfigError, match=r"`reward.model` is set by the e2e chain"):
        load_config(E2EConfig, {"model": str(lm), "reward": {"model": "x"}})
    with pytest.raises(ChatConfigError, match=r"`model` `.*nowhere` is not a model directory"):
        load_config(E2EConfig, {"model": str(tmp_path / "nowhere")})
    with pytest.raises(ChatConfigError, match=r"unknown key `stages`"):
        load_config(E2EConfig, {"model": str(lm), "stages": 3})
