"""`z bench offload` end to end on a tiny GPT: the ZeRO-Infinity mode (parameters and
optimizer on NVMe) runs with a width below 512, where an embedding shard outgrows an
MLP weight's (the parameter buffers were sized from the MLP alone and every rank
refused the embedding). Timings are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

Z = str(Path(sys.executable).parent / "z")


def test_nvme_all_runs_when_the_embedding_is_the_largest_parameter(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            Z,
            "bench",
            "offload",
            "--modes",
            "nvme_all",
            "--stage",
            "3",
            "--preset",
            "tiny",
            "--n-embd",
            "64",
            "--n-layer",
            "1",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--seq",
            "16",
            "--dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    mode = r["modes"]["nvme_all"]
    assert mode["optimizer"] == "NvmeStore" and len(mode["losses"]) == 1
    assert all(b > 0 for b in mode["nvme_bytes_per_rank"])
