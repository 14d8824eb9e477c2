"""What a process knows about itself and its local peers: its resident memory and a free
loopback port for a process group's rendezvous.

One copy for every package, benchmark and test that reports memory or starts local ranks
(zcore is the lowest package all of them may import; zserve and zquant, which may not, use
neither).
"""

from __future__ import annotations

import os
import socket
import sys


def rss_bytes() -> int:
    """This process's resident set size now, in bytes (Linux ``/proc/self/statm``); where
    that file does not exist, its peak resident set size (``getrusage``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource  # POSIX only; reached where /proc is not

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
