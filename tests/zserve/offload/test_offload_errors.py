"""Bad input to weight offload fails at start with an error that names it, and never hangs:
a budget below one decoder layer, an offload directory that is missing, read-only or full,
and offload options that make no sense together."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import zserve
from tests.utils.models import smollm2_dir
from zserve.config import EngineConfig
from zserve.offload import OffloadDirError, WeightsBudgetError

ROOT = Path(__file__).resolve().parents[3]
ENGINE = {"max_model_len": 64, "num_blocks": 8}


def test_budget_below_one_layer_fails_after_the_first_layer() -> None:
    with pytest.raises(WeightsBudgetError, match=r"budget 1048576 bytes \(1.0 MiB\) .* one"):
        zserve.pipeline(smollm2_dir(), weights_budget="1M", **ENGINE)


def test_missing_offload_dir_is_named(tmp_path) -> None:
    where = tmp_path / "nope"
    with pytest.raises(OffloadDirError, match=f"`{where}` does not exist") as info:
        zserve.pipeline(
            smollm2_dir(), weights_budget="64M", offload="nvme", offload_dir=str(where), **ENGINE
        )
    assert info.value.errno == errno.ENOENT


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"offload": "nvme"}, "need weights_budget"),
        ({"weights_budget": "64M", "speculative": "ngram"}, "no speculative decoding"),
        ({"weights_budget": "64M", "policy": "static"}, "policy 'splitfuse' or"),
    ],
)
def test_options_that_do_not_fit_are_refused(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)


def test_nvme_without_dir_and_a_bad_size_are_refused() -> None:
    with pytest.raises(ValueError, match="needs a directory"):
        EngineConfig(weights_budget="64M", offload="nvme").offload_spec()
    with pytest.raises(ValueError, match="is not a size"):
        EngineConfig(weights_budget="lots").offload_spec()


CHILD = """
import json, os, resource, signal, sys
{setup}
try:
    {call}
    print(json.dumps({{"ok": True}}))
except OSError as e:
    print(json.dumps({{"type": type(e).__name__, "errno": e.errno, "msg": str(e)}}))
"""


def _child(setup: str, call: str) -> dict:
    code = CHILD.format(setup=setup, call=call)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow(reason="a second child process; the full-directory case covers the start path")
def test_read_only_offload_dir_is_named(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    tmp_path.chmod(0o755)
    # Root ignores mode bits: the child drops to `nobody` once it has imported what it runs.
    drop = "os.setgid(65534); os.setuid(65534); " if os.geteuid() == 0 else ""
    call = (
        f"from zserve.offload.store import check_offload_dir; {drop}"
        f"check_offload_dir({str(ro)!r}, 1)"
    )
    res = _child("", call)
    assert res.get("type") == "OffloadDirError", res
    assert res["errno"] == errno.EACCES and "is not writable" in res["msg"], res
    assert str(ro) in res["msg"]


def test_full_offload_dir_is_named(tmp_path) -> None:
    # A file size limit of 1 MiB: the first layer's write fails as a full disk does (EFBIG).
    setup = (
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))"
    )
    call = (
        "import zserve; from tests.utils.models import smollm2_dir; "
        f"zserve.pipeline(smollm2_dir(), weights_budget='64M', offload='nvme', "
        f"offload_dir={str(tmp_path)!r}, max_model_len=64, num_blocks=8)"
    )
    res = _child(setup, call)
    assert res.get("type") == "OffloadDirError", res
    assert res["errno"] == errno.EFBIG and "writing layer 0" in res["msg"], res
    assert "is full" in res["msg"] and "free space" in res["msg"], res
