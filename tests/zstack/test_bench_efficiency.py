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
    from ztrain.gpt import GPTConfig

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
    half = (
        3
        * 8
        * (
            2 * (256 * 24 * d * d + 4 * 256 * 256 * d)
            + 10 * (128 * 24 * d * d + 4 * 128 * 128 * d)
            + 2 * 256 * d * v
        )
    )
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


def test_scala_play_task_is_balanced_and_held_out_lines_come_from_the_play_ends() -> None:
    sc = load("_scala")
    assert [label for label, _ in sc.task_classes("play")] == list(sc.PLAYS)
    task = sc.build_task(per_class_train=40, per_class_eval=10, task="play")
    assert task.labels == sc.PLAYS
    assert [task.train_labels.count(k) for k in range(6)] == [40] * 6
    assert [task.eval_labels.count(k) for k in range(6)] == [10] * 6
    assert not set(task.train) & set(task.eval)  # train: first 80% of a play, eval: last 20%
    with pytest.raises(ValueError, match="task 'plays' is not one of"):
        sc.task_classes("plays")
    with pytest.raises(ValueError, match="arms 'both'"):
        sc.scala_section(arms="both")


def test_scala_target_is_a_fraction_of_the_baseline_median_final_accuracy() -> None:
    sc = load("_scala")
    assert sc.target_accuracy([0.5, 0.42, 0.46], 0.95) == round(0.95 * 0.46, 4)
    curve = [{"step": 4, "accuracy": 0.3}, {"step": 8, "accuracy": 0.44}]
    assert sc.first_step(curve, sc.target_accuracy([0.46], 0.95)) == 8  # 0.437 <= 0.44


def test_scala_report_lines_state_both_arms_and_the_ratios() -> None:
    sc = load("_scala")
    arm = {
        "steps_to_target": sc._spread([8, None, 12], cap=16),
        "final_accuracy": sc._acc_spread([0.4, 0.38, 0.41]),
        "s_per_step": 2.0,
    }
    settings = {
        "batch": 128,
        "lr": 1e-3,
        "scala_lr": 3e-3,
        "adv_max_norm": 0.1,
        "adv_steps": 1,
        "adv_start_step": 0,
        "seeds": 3,
        "max_steps": 16,
    }
    result = {
        "task": "t",
        "settings": settings,
        "line_embedding_norm": 4.1,
        "target": 0.38,
        "target_from": "0.95 x",
        "baseline": arm,
        "scala": arm,
        "step_ratio": 1.0,
        "s_per_step_ratio": 1.5,
        "time_ratio": 1.5,
        "fewer_steps": False,
    }
    lines = eff._scala_lines(result)
    assert "counts as 17" in lines[0] and "scala lr 0.003" in lines[0]
    assert "median 12 (min 8, max 17; per seed [8, None, 12])" in lines[1]
    assert lines[-1].endswith("fewer steps: no") and "1.50x the time per step" in lines[-1]
