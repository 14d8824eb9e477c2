"""How the host's idle cores wait while the engine has requests in flight: halt (the kernel's
choice) or poll, through Linux's CPU latency QoS (``/dev/cpu_dma_latency``).

A tensor-parallel decode step is a chain of small exchanges between ranks (an all-reduce
after each attention and each MLP), and each one wakes the waiting rank: a core that halted
while it waited must first be woken by an inter-processor interrupt, which on a virtual
machine is a trip through the hypervisor (measured: ``benchmarks/results/serve-tp.md``). A
process that holds ``/dev/cpu_dma_latency`` open with a 0 us request keeps every core out of
its halt states (they poll for work instead) until it closes it; the kernel drops the
request when the process exits, however it exits, so nothing is left behind by a crash. (The
per-core knob, ``/sys/devices/system/cpu/cpuN/power/pm_qos_resume_latency_us``, would poll
only the ranks' cores but outlives a crashed process: not used.)

The engine holds it only while requests are in flight (from the first step that runs a
forward to the step that leaves nothing unfinished): an idle server's cores halt as before.
Polling cores burn their idle time, which on a shared host is other tenants' CPU, hence
``halt`` for a single process (``tp=1``, where polling gained nothing consistent) and when
asked.
"""

from __future__ import annotations

import logging
import os
import struct
import weakref

from zserve.config import CpuIdle

log = logging.getLogger(__name__)

QOS_DEVICE = "/dev/cpu_dma_latency"
"""Linux's CPU latency QoS device: a 32-bit request in microseconds, held while open."""


class CpuIdleError(OSError):
    """``cpu_idle="poll"`` was asked for and the process cannot hold the request."""


class IdlePolling:
    """A hold on the CPU latency QoS at 0 us (idle cores poll), taken and given back as the
    engine's work starts and ends (:meth:`hold`, :meth:`release`)."""

    def __init__(self, device: str = QOS_DEVICE) -> None:
        self.device = device
        self._close: weakref.finalize | None = None
        """Closes the held device file: a finalizer, so at the latest when this is collected."""

    @classmethod
    def for_engine(cls, mode: CpuIdle, tp: int, device: str = QOS_DEVICE) -> IdlePolling | None:
        """The engine's hold for ``mode`` at ``tp`` ranks, or None (cores halt).

        Raises:
            CpuIdleError: ``mode == "poll"`` and ``device`` cannot be written.
        """
        if mode == "halt" or (mode == "auto" and tp < 2):
            return None
        exc = unavailable(device)  # checked at start-up: an explicit "poll" that cannot fails
        if exc is None:
            return cls(device)
        if mode == "poll":
            raise CpuIdleError(
                f"cpu_idle 'poll' needs to write `{device}` (Linux's CPU latency QoS) and "
                f"cannot ({exc.strerror or exc}): run as root or give this user write "
                "access to it, or serve with cpu_idle 'auto' or 'halt'"
            ) from exc
        log.info("zserve: idle cores halt between exchanges (%s: %s)", device, exc)
        return None

    @property
    def held(self) -> bool:
        return self._close is not None

    def hold(self) -> None:
        """Request 0 us wake-up latency (idle cores poll) until :meth:`release`; a no-op
        when held."""
        if self._close is not None:
            return
        fd = os.open(self.device, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, struct.pack("=i", 0))
        except BaseException:
            os.close(fd)
            raise
        self._close = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        """Drop the request (idle cores halt again); a no-op when not held."""
        if self._close is not None:
            close, self._close = self._close, None
            close()


def unavailable(device: str = QOS_DEVICE) -> OSError | None:
    """Why this process cannot hold the CPU latency QoS (opening ``device`` for writing
    fails), or None where it can."""
    try:
        os.close(os.open(device, os.O_WRONLY | os.O_CLOEXEC))
    except OSError as exc:
        return exc
    return None


def current_request(device: str = QOS_DEVICE) -> int:
    """The CPU latency (us) the kernel now honours: the smallest request held by any
    process (2000000000, the kernel's default, when none)."""
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return int(struct.unpack("=i", os.read(fd, 4))[0])
    finally:
        os.close(fd)
