"""`z bench cp`'s arithmetic and option checks (its 2-rank run is the smoke case in
``tests/zstack/smoke_cases_cp.py``; the measured runs are in ``benchmarks/results/cp.md``)."""

from __future__ import annotations

import pytest

from zstack.bench import load


def _row(max_seq: int, tokens_per_s: float, peak: float, floor: float = 0.0) -> dict:
    row = {"max_seq": max_seq, "tokens_per_s": tokens_per_s, "fixed_peak_mib": peak}
    return {**row, "floor_peak_mib": floor, "activation_mib": peak - floor}


def test_ratios_are_against_cp1() -> None:
    rows = {
        "cp1": _row(1000, 100.0, 200.0),
        "cp1_tiled": _row(2000, 80.0, 120.0),
        "cp2": _row(1900, 90.0, 110.0),
        "cp2_tiled": _row(4000, 70.0, 60.0),
    }
    r = load("cp")._ratios(rows)
    assert r["max_seq_ratio"] == 4.0
    assert r["max_seq_ratio_cp1_tiled"] == 2.0 and r["max_seq_ratio_cp2"] == 1.9
    assert r["tokens_per_s_ratio_cp2"] == 0.9 and r["fixed_peak_ratio_cp2"] == 0.55
    assert load("cp")._ratios({"cp2": rows["cp2"]}) == {}
    # activation memory: each side's peak less its floor step's, which does not halve with cp
    act = load("cp")._ratios(
        {"cp1": _row(1000, 1.0, 330.0, 60.0), "cp2": _row(1, 1.0, 200.0, 60.0)}
    )
    assert act["fixed_peak_ratio_cp2"] == 200.0 / 330.0 and act["activation_ratio_cp2"] == 140 / 270
    ckpt = load("cp")._ratios({"cp1": rows["cp1"], "cp2_tiled_ckpt": _row(8000, 50.0, 40.0)})
    assert (
        ckpt["max_seq_ratio_cp2_tiled_ckpt"] == 8.0
        and ckpt["fixed_peak_ratio_cp2_tiled_ckpt"] == 0.2
    )


def test_each_target_is_flagged_met_or_not_and_printed() -> None:
    cp = load("cp")
    rows = {"cp1": _row(1000, 100.0, 200.0, 20.0), "cp2": _row(1900, 79.0, 110.0, 20.0)}
    rows["cp2_tiled"] = _row(2500, 70.0, 60.0)
    t = cp.targets(cp._ratios(rows))
    assert t["max_seq_ratio"]["met"] is True and t["max_seq_ratio"]["value"] == 2.5
    assert t["tokens_per_s_ratio_cp2"]["met"] is False  # 0.79 < 0.8
    assert t["activation_ratio_cp2"]["met"] is True  # 90 / 180 = 0.5 <= 0.55
    result = {"model": "small", "params": 2e6, "variants": rows, "targets": t}
    result["options"] = {"stage": 3, "budget_mib": 256.0, "seq": 2048}
    text = cp.report({**result, "max_seq_ratio_cp2": 1.9})
    assert "max_seq_ratio_cp2: 1.90" in text
    assert "target max_seq_ratio (longest sequence, cp2_tiled over cp1): 2.50 >= 2.5: met" in text
    assert (
        "target tokens_per_s_ratio_cp2 (tokens/s at --seq, cp2 over cp1): 0.79 >= 0.8: NOT met"
        in text
    )
    alone = cp.targets(cp._ratios({"cp2_tiled": rows["cp2_tiled"]}))
    assert all(v["met"] is None for v in alone.values())
    assert "not measured" in cp.report({**result, "targets": alone})


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"variants": "cp3"}, "cp3"),
        ({"seq": 0}, "--seq"),
        ({"floor_seq": 4096}, "--floor-seq < --seq"),
        ({"probe_repeats": 0}, "--probe-repeats"),
        ({"resolution": 0}, "--resolution"),
        ({"model": "nowhere"}, "nowhere"),
    ],
)
def test_bad_options_are_named(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load("cp").run(**options)


def test_the_length_search_brackets_the_budget_to_its_resolution() -> None:
    probed: list[int] = []

    def peak(seq: int) -> float:  # 100 MiB fixed + 0.01 MiB a token: 15000 fits 250
        probed.append(seq)
        return 100.0 + seq / 100

    longest = load("cp").longest
    lo, trials = longest(peak, 256, 1 << 16, 250.0, 32)
    assert lo <= 15000 < lo + max(lo // 32, 8) and [s for s, _ in trials] == probed
    assert probed[:7] == [256, 512, 1024, 2048, 4096, 8192, 16384] and len(probed) == 12
    assert longest(peak, 256, 1 << 16, 250.0, 16)[0] <= lo  # coarser: as far or less
    assert longest(peak, 256, 1024, 1e9, 32) == (
        1024,
        [(256, 102.56), (512, 105.12), (1024, 110.24)],
    )
    assert longest(peak, 256, 1 << 16, 50.0, 32)[0] == 0  # not even the first length
