"""The smoke case of `z bench pipe` (registered into test_cli_smoke's CASES, which imports
this module)."""

from __future__ import annotations

from tests.zstack.test_cli_smoke import Work, smoke


@smoke("bench pipe")
def _bench_pipe(w: Work) -> None:
    r = w.json(
        "bench",
        "pipe",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--seq",
        "8",
        "--layers",
        "2",
        "--width",
        "32",
        "--vocab",
        "53",
        "--no-memory",
        "--no-zbv",
        "--json",
    )
    assert r["benchmark"] == "pipe" and set(r["sides"]) == {"ours", "torch_1f1b", "ddp"}
    assert r["vs_torch_1f1b"] > 0 and r["vs_ddp"] > 0
