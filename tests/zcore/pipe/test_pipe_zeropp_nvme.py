"""ZeRO++ and NVMe offload under a pipeline: pp2 x dp2 at ZeRO-3 against single-process training.

The keys act inside the pipeline's own stage-3 path (each stage's cut parameters gathered once
a step, `HeldParameters`), not only in the per-module hooks the pipeline turns off:

- ``offload_param`` / ``offload_optimizer`` on NVMe (swap files through the native io_uring
  engine): the same arithmetic as in memory, so the tolerances of ``test_pipe_stage3.py``
  (losses 2e-5, every gathered parameter 1e-4 absolute);
- hpZ (``zero_hpz_partition_size`` 2: the secondary copy within each stage's dp pair): the
  same, and still one all-gather of every cut parameter per step;
- qwZ (weights gathered in int8 blocks) and qgZ (gradients reduced in int4/int8): lossy by
  design, so the losses must stay within 0.5% of the baseline's (measured: 0.08% at most over
  3 steps) and differ from it (the key acts; a silently ignored key would equal it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.distributed import run_ranks
from tests.zcore.pipe.common import baseline
from tests.zcore.pipe.test_pipe_stage3 import MB, _run

STEPS, GAS = 3, 2


def _outs(zero: dict[str, Any]) -> tuple[list[dict], list[float], dict[str, torch.Tensor]]:
    outs = run_ranks(_run, 4, args=(STEPS, GAS, zero, "1f1b", {}), timeout=300)
    ref_losses, ref = baseline(STEPS, 2, MB, GAS, tied=True)
    return outs, ref_losses, ref


@pytest.mark.slow(reason="4 ranks per key set, 3 steps each: ~40 s apiece on 2 cores")
@pytest.mark.parametrize(
    "kind", ["offload_param-nvme", "offload_optimizer-nvme", "hpz"], ids=lambda k: k
)
def test_exact_keys_match_single_process(kind: str, tmp_path: Path) -> None:
    zero = {
        "offload_param-nvme": {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "offload_optimizer-nvme": {
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}
        },
        "hpz": {"zero_hpz_partition_size": 2},
    }[kind]
    outs, ref_losses, ref = _outs(zero)
    for out in outs:
        assert out["losses"][:STEPS] == pytest.approx(ref_losses, abs=2e-5)
        for name, value in out["params"].items():
            torch.testing.assert_close(value, ref[name], atol=1e-4, rtol=0, msg=name)
        assert out["per_step"] == [(out["once"], 1)] * STEPS


@pytest.mark.slow(reason="4 ranks per key, 3 steps each: ~40 s apiece on 2 cores")
@pytest.mark.parametrize("key", ["zero_quantized_weights", "zero_quantized_gradients"])
def test_quantized_keys_act_and_stay_close(key: str) -> None:
    outs, ref_losses, _ = _outs({key: True})
    for out in outs:
        got = out["losses"][:STEPS]
        assert got == pytest.approx(ref_losses, rel=5e-3), (got, ref_losses)
        assert got != pytest.approx(ref_losses, abs=1e-6), "the key changed nothing"
