"""`z bench efficiency`'s arithmetic, without training: the curriculum's step count for the
baseline's tokens, the validation curve (tokens and training seconds), the stability summary
and the option checks. The run itself is the smoke case in test_cli_smoke.py."""

from __future__ import annotations

import math

import pytest

from zstack.bench import load

eff = load("efficiency")


def test_curriculum_steps_reach_the_baseline_tokens_and_no_fewer() -> None:
    o = eff.Options(steps=100, seq_len=128, micro_batch=8, min_seqlen=16, curriculum_frac=0.5)
    target = 100 * 8 * 128
    steps = eff._steps_for_tokens(o, target)

    def tokens(n: int) -> int:  # fixed_linear 16 -> 128 over round(0.5 n), multiples of 8
        total = max(1, round(0.5 * n))
        per = [min(128, math.floor(s / total * 112 + 16) // 8 * 8) for s in range(1, n + 1)]
        return 8 * sum(per)

    assert tokens(steps) >= target
    assert steps > 100  # shorter early batches need more steps for the same tokens
    assert tokens(steps - 1) < target or steps - 1 < 100


def test_curve_sums_step_times_and_skips_validation() -> None:
    records = [
        {"step": 0, "val_loss": 7.0},
        {"step": 1, "loss": 6.9, "tokens": 100, "tokens_per_s": 50.0},
        {"step": 2, "loss": 6.5, "tokens": 300, "tokens_per_s": 100.0, "val_loss": 6.4},
    ]
    assert eff._curve(records) == [
        {"step": 0, "tokens": 0, "train_s": 0.0, "val_loss": 7.0},
        {"step": 2, "tokens": 300, "train_s": 4.0, "val_loss": 6.4},  # 100/50 + 200/100
    ]


def test_summary_spike_and_divergence() -> None:
    fine = [{"val_loss": 7.0}, {"loss": 6.0}, {"loss": 6.5}, {"loss": 5.0}, {"val_loss": 5.5}]
    assert eff._summary(fine) == {"final_val_loss": 5.5, "max_loss_spike": 0.5, "diverged": False}
    worse = [{"val_loss": 7.0}, {"loss": 6.0}, {"val_loss": 7.5}]
    assert eff._summary(worse)["diverged"]
    nan = [{"val_loss": 7.0}, {"loss": float("nan")}, {"val_loss": 6.0}]
    assert eff._summary(nan)["diverged"]


def test_bad_options_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--sections 'nonesuch': unknown"):
        eff.run(sections="nonesuch")
    with pytest.raises(ValueError, match="--min-seqlen 12: must be a multiple of 8"):
        eff.run(min_seqlen=12)


def test_random_ltd_block_loads_and_flops_follow_the_kept_tokens() -> None:
    from zcore.config import ZConfig
    from zstack.recipes.gpt import GPTConfig

    ltd = load("_random_ltd")
    for seq, steps in ((256, 60), (64, 2)):
        de = ZConfig.load({"train_batch_size": 8, "data_efficiency": ltd.ltd_block(seq, steps)})
        block = de.extension("data_efficiency").random_ltd
        assert block.random_ltd_layer_id == list(range(1, 11))
        assert block.random_ltd_schedule.max_value == seq
        assert block.random_ltd_schedule.schedule_config.require_steps == steps - 1
    assert (
        ltd.ltd_block(256, 60)["data_routing"]["random_ltd"]["random_ltd_schedule"]["min_value"]
        == 32
    )
    cfg = GPTConfig.preset("deep", vocab_size=2048)
    d, v = 128, 2048
    full = 3 * 8 * (12 * (256 * 24 * d * d + 4 * 256 * 256 * d) + 2 * 256 * d * v)
    assert ltd.step_flops(cfg, 8, 256, 256) == full
    half = 3 * 8 * (2 * (256 * 24 * d * d + 4 * 256 * 256 * d)
                    + 10 * (128 * 24 * d * d + 4 * 128 * 128 * d) + 2 * 256 * d * v)  # fmt: skip
    assert ltd.step_flops(cfg, 8, 256, 128) == half


def test_scala_section_is_registered_and_its_task_keeps_spoken_lines_only() -> None:
    assert "scala" in eff.SECTIONS
    sc = load("_scala")
    text = (
        "ACT I\n\nSCENE II. Athens. The palace of THESEUS.\n\nHAMLET:\n"
        "O that this too too solid flesh would melt,\n[Exit]\nAy, my lord. [Aside] So.\n"
        "Thaw and resolve itself into a dew!\n"
    )
    assert sc.spoken_lines(text, min_words=5) == [
        "O that this too too solid flesh would melt,",
        "Thaw and resolve itself into a dew!",
    ]  # headings, the speaker, the direction and a 4-word line (its aside removed) go
    assert not set(sc.COMEDIES) & set(sc.TRAGEDIES)


def test_scala_spread_counts_a_missed_target_past_the_cap() -> None:
    spread = load("_scala")._spread([6, None, 4], cap=10)
    assert spread == {"per_seed": [6, None, 4], "median": 6, "min": 4, "max": 11, "reached": 2}
    curve = [
        {"step": 2, "accuracy": 0.5},
        {"step": 4, "accuracy": 0.6},
        {"step": 6, "accuracy": 0.58},
    ]
    assert [load("_scala").first_step(curve, lv) for lv in (0.5, 0.58, 0.6, 0.61)] == [
        2,
        4,
        4,
        None,
    ]
