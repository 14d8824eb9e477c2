"""The smoke case of `z bench tp` (registered into test_cli_smoke's CASES, which imports
this module)."""

from __future__ import annotations

from tests.zstack.test_cli_smoke import Work, smoke


@smoke("bench tp")
def _bench_tp(w: Work) -> None:
    r = w.json(
        "bench",
        "tp",
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--micro-batch",
        "2",
        "--seq-len",
        "8",
        "--json",
    )
    assert set(r["contenders"]) == {"zcore_tp", "dtensor_tp", "dtensor_tp_lp", "dp"}
    assert r["vs_dtensor"] > 0 and r["vs_dp"] > 0 and 0 < r["state_vs_tp1"] <= 0.55
