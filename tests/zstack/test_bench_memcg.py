"""`benchmarks/_memcg.py`: the memory cgroup `z bench serve-offload` puts llama.cpp in is
made under this process's own, limits what a process in it holds, and is removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zstack.bench import load

memcg = load("_memcg")

# Joins the group, then maps and touches a 48 MiB file twice: the group (limit 16 MiB) holds
# at most its limit, so the second pass reads the file again from storage.
CHILD = """
import mmap, os, sys
group, path = sys.argv[1], sys.argv[2]
open(os.path.join(group, "cgroup.procs"), "w").write(str(os.getpid()))
with open(path, "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    for _ in range(2):
        total = sum(m[i] for i in range(0, len(m), 4096))
print(total)
"""


def test_a_group_limits_a_mapped_file_and_is_removed(tmp_path: Path) -> None:
    group, why = memcg.make("-test")
    if group is None:
        pytest.skip(f"no memory cgroup here: {why}")
    data = tmp_path / "blob"
    with open(data, "wb") as f:  # written back and out of the page cache: read in the group
        f.write(b"\x01" * (48 << 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        memcg.set_limit(group, 16 << 20)
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(group), str(data)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert int(done.stdout) == (48 << 20) // 4096  # every page read, each holding 1
        s = memcg.stats(group)
        assert s["limit_bytes"] == 16 << 20
        assert 0 < s["peak_bytes"] <= 16 << 20 and s["limit_hits"] > 0, s
    finally:
        memcg.remove(group)
    assert not group.exists()
