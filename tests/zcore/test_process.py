"""`zcore.process`: a process's resident memory and a free loopback port."""

from __future__ import annotations

import socket

from zcore.process import free_port, rss_bytes


def test_rss_bytes_is_plausible() -> None:
    assert 10 * 2**20 < rss_bytes() < 64 * 2**30


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
