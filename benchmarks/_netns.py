"""Emulated slow links for the multi-rank benchmarks: Linux network namespaces joined by a
veth pair, each end rate-limited with ``tc`` (a token bucket on its egress).

Two "nodes" are two namespaces; each holds one end of one veth pair (``veth0`` in both,
``10.77.0.1`` and ``10.77.0.2``), so whatever crosses between them goes through two
rate-limited queues, one per direction, while ranks inside one namespace talk over its
loopback (the kernel routes a namespace's own address locally): intra-node traffic is
unlimited, inter-node traffic is held to the rate. The link is made inside the namespaces
(``ip link add ... netns A type veth peer ... netns B``), so nothing appears in the
caller's namespace and the names only need to be unique per run for the namespaces
themselves (``zbench-<pid>-<random>-<i>``); addresses live inside them and cannot collide.

Load with ``zcore.bench.load("_netns", Path(__file__).parent)``::

    with Link.create() as link:          # OSError (with the reason) when it cannot
        link.set_rate("100mbit")
        Popen(link.exec_prefix(0) + [sys.executable, ...])

Everything is removed on exit from the ``with`` block, on SIGINT/SIGTERM while it is
open, and at interpreter exit. Needs root (``CAP_NET_ADMIN``) and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
from types import FrameType, TracebackType
from typing import Any

ADDRESSES = ("10.77.0.1", "10.77.0.2")
"""The veth end's address in namespace 0 and 1 (a /30 of their own)."""
IFNAME = "veth0"
"""The link's interface name in each namespace (what ``GLOO_SOCKET_IFNAME`` names)."""
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if found is None:
        raise OSError(f"`{name}` not found; install iproute2 (`apt-get install iproute2`)")
    return found


def rate_bits(rate: str) -> int:
    """``"100mbit"`` -> 100_000_000 bits/s; ValueError naming the rate and the form."""
    rate = rate.strip().lower()
    m = _RATE.match(rate)
    if m is None:
        raise ValueError(
            f"--rates: {rate!r} is not a tc rate; give a number and a unit, e.g. "
            "10gbit, 1gbit, 100mbit"
        )
    return int(float(rate[: -len(m.group(2))]) * _UNITS[m.group(2)])


class Link:
    """Two namespaces joined by one rate-limited veth pair (see the module docstring)."""

    def __init__(self, names: tuple[str, str]) -> None:
        self.names = names
        self.rate: str | None = None
        self._ip = _tool("ip")
        self._tc = _tool("tc")
        self._closed = False
        self._old: dict[int, Any] = {}

    @classmethod
    def create(cls) -> Link:
        """Make the namespaces and the link; raises OSError saying why it could not (and
        leaves nothing behind)."""
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            raise OSError("network namespaces need root (CAP_NET_ADMIN); run as root")
        token = f"{os.getpid()}-{secrets.token_hex(3)}"
        link = cls((f"zbench-{token}-0", f"zbench-{token}-1"))
        link._catch_signals()
        try:
            for ns in link.names:
                link._run(link._ip, "netns", "add", ns)
            a, b = link.names
            link._run(
                link._ip,
                "link",
                "add",
                IFNAME,
                "netns",
                a,
                "type",
                "veth",
                "peer",
                "name",
                IFNAME,
                "netns",
                b,
            )
            for ns, addr in zip(link.names, ADDRESSES, strict=True):
                link._run(link._ip, "-n", ns, "addr", "add", f"{addr}/30", "dev", IFNAME)
                link._run(link._ip, "-n", ns, "link", "set", IFNAME, "up")
                link._run(link._ip, "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            link.close()
            raise
        return link

    def _run(self, *cmd: str) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if proc.returncode:
            raise OSError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")

    def set_rate(self, rate: str | None) -> None:
        """Hold each direction of the link to ``rate`` (a tc rate: ``100mbit``); None: no
        limit. A token bucket on each end's egress: the burst is 10 ms of the rate, at
        least 256 KiB so that the veth's large (GSO) packets pass, and a packet waits at
        most 100 ms in the queue (TCP then slows to the rate)."""
        for ns in self.names:
            if self.rate is not None:
                self._run(self._tc, "-n", ns, "qdisc", "del", "dev", IFNAME, "root")
            if rate is not None:
                burst = max(rate_bits(rate) // 8 // 100, 256 * 1024)
                self._run(
                    self._tc,
                    "-n",
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    IFNAME,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    str(burst),
                    "latency",
                    "100ms",
                )
        self.rate = rate

    def exec_prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program inside namespace ``node`` (0 or 1)."""
        return [self._ip, "netns", "exec", self.names[node]]

    def qdisc(self, node: int) -> str:
        """``tc -s qdisc show`` of node ``node``'s link end (what was sent, dropped)."""
        out = subprocess.run(
            [self._tc, "-n", self.names[node], "-s", "qdisc", "show", "dev", IFNAME],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip()

    def close(self) -> None:
        """Delete both namespaces (and with them the link and its qdiscs); idempotent."""
        if self._closed:
            return
        self._closed = True
        for ns in self.names:
            subprocess.run([self._ip, "netns", "del", ns], capture_output=True, timeout=30)
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        atexit.unregister(self.close)

    def exists(self) -> bool:
        """Whether either namespace is still there (``ip netns list``)."""
        out = subprocess.run([self._ip, "netns", "list"], capture_output=True, text=True)
        listed = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
        return any(ns in listed for ns in self.names)

    def _catch_signals(self) -> None:
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: atexit and `with` still clean up
                pass

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.close()
        raise KeyboardInterrupt(f"signal {signum}")

    def __enter__(self) -> Link:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
