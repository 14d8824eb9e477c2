"""`z bench io` end to end at 8 MiB: one JSON object last, every contender
measured on the same file system with its read-back verified and every read
cold (O_DIRECT, or no page of the file cached when it began), and the
DeepSpeed entry either measured or explained. Timings are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import znative
from zstack.bench import load

Z = str(Path(sys.executable).parent / "z")


def test_bench_io_json_shape_and_verified_reads(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            Z,
            "bench",
            "io",
            "--size",
            "8MiB",
            "--dir",
            str(tmp_path),
            "--block-size",
            "256KiB",
            "--queue-depth",
            "16",
            "--rounds",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["benchmark"] == "io" and r["size_bytes"] == 8 << 20
    assert r["ok"] is True  # every read-back verified (else z bench exits 1)
    assert (r["block_size"], r["queue_depth"], r["rounds"]) == (256 << 10, 16, 1)
    assert r["dir"] == str(tmp_path) and r["filesystem"]
    names = {"zstack_threads", "python_write_fsync_readinto", "torch_save_load"}
    if znative.io_backend_probe()[0] == "io_uring":
        names.add("zstack_io_uring")
    assert names <= set(r["results"])
    for name, c in r["results"].items():
        assert c["verified"] is True, name
        assert c["write_gb_per_s"] > 0 and c["read_gb_per_s"] > 0, name
        assert c["cached_bytes_at_read"] == 0, (name, c["read_mode"])
        want = (
            "O_DIRECT" if c["o_direct"] else "buffered, cold (fdatasync + posix_fadvise DONTNEED)"
        )
        assert c["read_mode"] == want, name
        assert ("rewrite_gb_per_s" in c) == c["o_direct"], name  # O_DIRECT paths rewrite in place
    for name in ("zstack_threads", "zstack_io_uring"):
        if name in r["results"]:
            stats = r["results"][name]["stats"]
            assert stats["direct"] == stats["requests"] > 0 and stats["bounced"] == 0
    assert r["ours"] in r["results"]
    if "deepspeed_aio" in r["results"]:
        assert r["deepspeed_aio"] == "ok"
        assert set(r["ratio_ours_over_deepspeed_gb_per_s"]) == {"write", "read", "rewrite"}
    else:
        assert r["deepspeed_aio"] and r["ratio_ours_over_deepspeed_gb_per_s"] is None
    assert list(tmp_path.iterdir()) == [], "benchmark files are removed"


def test_drop_cache_leaves_no_page_and_the_check_sees_pages(tmp_path: Path) -> None:
    """The coldness check is real: a file just written or just read has pages in the cache
    (mincore sees them), and after drop_cache none is left."""
    io = load("io")
    path = tmp_path / "f.bin"
    data = os.urandom(3 << 20) + b"tail"  # not a whole number of pages
    path.write_bytes(data)
    assert io.resident_bytes(path) > 0, "a file just written through the cache has pages there"
    assert io.drop_cache(path) == 0
    assert io.resident_bytes(path) == 0
    assert path.read_bytes() == data
    assert io.resident_bytes(path) == len(data), "a buffered read fills the cache again"
    assert io.drop_cache(path) == 0 and io.resident_bytes(path) == 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["io", "--size", "lots", "--no-ds"], ["size 'lots'", "1GiB"]),
        (["io", "--size", "1MiB", "--dir", "/nonexistent/zstack", "--no-ds"], ["--dir"]),
        (["zero", "--stages", "1,x"], ["--stages", "'x' is not an integer"]),
        (["serve", "--short-prompt", "8"], ["--short-prompt", "expected 2"]),
    ],
    ids=["size", "dir", "stages", "pair"],
)
def test_bad_bench_options_are_one_line_errors(args: list[str], words: list[str]) -> None:
    """Exit code 2 and `error: z bench NAME: ...` naming the option; no traceback."""
    out = subprocess.run([Z, "bench", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.startswith(f"error: z bench {args[0]}: ")
    for w in words:
        assert w in out.stderr, out.stderr
