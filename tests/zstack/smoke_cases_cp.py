"""The smoke case of `z bench cp` (registered into test_cli_smoke's CASES, which imports this
module): one variant (cp=2 with tiling) of a one-layer model, a few tokens, its two launches
(speed, memory)."""

from __future__ import annotations

from tests.zstack.test_cli_smoke import Work, smoke


@smoke("bench cp")
def _bench_cp(w: Work) -> None:
    sizes = ["--layers", "1", "--budget-mib", "4096", "--seq", "32", "--start-seq", "16"]
    sizes += ["--max-seq", "32", "--steps", "1", "--warmup", "0", "--loss-tile", "8"]
    sizes += ["--floor-seq", "8", "--probe-repeats", "1", "--resolution", "4"]
    r = w.json("bench", "cp", *sizes, "--mlp-tile", "8", "--variants", "cp2_tiled", "--json")
    row = r["variants"]["cp2_tiled"]
    assert row["max_seq"] == 32 and row["tokens_per_s"] > 0 and row["fixed_peak_mib"] > 0, row
    assert row["activation_mib"] == row["fixed_peak_mib"] - row["floor_peak_mib"], row
    assert "max_seq_ratio" not in r  # no cp1 run to divide by
