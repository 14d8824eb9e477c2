"""What the multi-rank benchmarks share: a free loopback port for the rendezvous and the
resident memory of a rank. Load it with ``zcore.bench.load("_ranks", Path(__file__).parent)``."""

from __future__ import annotations

import sys

from zcore.process import free_port

__all__ = ["free_port", "memory_mb"]


def memory_mb() -> dict[str, float]:
    """Current and peak resident memory of this process, MB (VmRSS / VmHWM)."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(rest.split()[0]) / 1024
    except OSError:  # not Linux: ru_maxrss is the peak (kB on Linux, bytes on macOS)
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["VmHWM"] = peak / (2**20 if sys.platform == "darwin" else 1024)
    return out
