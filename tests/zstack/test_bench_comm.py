"""`z bench comm`: the same training over an emulated slow link, with the bytes it sent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zstack.bench import load

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_loopback_run_reports_time_bytes_and_loss() -> None:
    z = Path(sys.executable).parent / "z"
    proc = subprocess.run(
        [
            str(z),
            "bench",
            "comm",
            "--loopback",
            "--ranks",
            "2",
            "--entries",
            "adam",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["transport"] == "loopback" and result["fallback_reason"] is None
    assert (result["steps"], result["warmup"]) == (3, 1)
    [run] = result["runs"]
    assert (run["ranks"], run["nodes"], run["ranks_per_node"]) == (2, 2, 1)
    adam = run["entries"]["adam"]
    assert adam["status"] == "ok", adam
    assert adam["timed_steps"] == 2 and adam["step_time_s"] > 0
    assert 0 < adam["final_loss"] < 10 and 0 < adam["val_loss"] < 10
    # one rank per node: everything crosses nodes; ZeRO 0 all-reduces every fp32 gradient
    # once, 2 (w - 1) / w * 4 bytes per parameter = 4 on 2 ranks
    params = result["model"]["params"]
    assert adam["bytes_per_step"] == {"intra": 0, "inter": 4 * params, "total": 4 * params}
    assert adam["bytes_per_step_by_op"] == {"all_reduce": 4 * params}
    assert run["speedups"] == {}  # no contender ran


def test_refused_config_is_reported_with_its_error(tmp_path: Path) -> None:
    comm = load("comm")
    entry = comm.Entry("nope", 2, "NoSuchOptimizer", baseline="adam")
    cfg = tmp_path / "nope.json"
    cfg.write_text(json.dumps(entry.config(10)))
    options = {"preset": "tiny", "steps": 30, "micro_batch": 4, "seq_len": 64}
    error = comm._refusal(entry, cfg, tmp_path, options)
    assert error is not None and "NoSuchOptimizer" in error
    adam = comm.Entry("adam", 2, "Adam")
    cfg.write_text(json.dumps(adam.config(10)))
    assert comm._refusal(adam, cfg, tmp_path, options) is None


def test_bad_options_name_the_flag() -> None:
    comm = load("comm")
    with pytest.raises(ValueError, match="--rates: '100mbps' is not a tc rate"):
        comm.run(rates="100mbps", loopback=True)
    with pytest.raises(ValueError, match=r"--ranks '3': \[3\] not supported"):
        comm.run(ranks="3", loopback=True)
    with pytest.raises(ValueError, match="--entries: unknown"):
        comm.run(entries_="adam,fast", loopback=True)
    with pytest.raises(ValueError, match="--warmup 30 must be below --steps 30"):
        comm.run(warmup=30, loopback=True)


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")):
        return "iproute2's `ip` is not installed"
    return None


@pytest.mark.skipif(_can_make_namespaces() is not None, reason=str(_can_make_namespaces()))
def test_namespace_pair_is_linked_rate_limited_and_removed() -> None:
    netns = load("_netns")
    with netns.Link.create() as link:
        assert link.exists()
        link.set_rate("100mbit")
        for node in (0, 1):
            assert "tbf" in link.qdisc(node) and "rate 100Mbit" in link.qdisc(node)
        # the two namespaces reach each other over the link, and only there
        server = subprocess.Popen(
            [
                *link.exec_prefix(1),
                sys.executable,
                "-c",
                "import socket\ns = socket.create_server(('10.77.0.2', 7000))\n"
                "c, _ = s.accept()\nc.sendall(c.recv(16)[::-1])",
            ],
        )
        client = subprocess.run(
            [
                *link.exec_prefix(0),
                sys.executable,
                "-c",
                "import socket, time\n"
                "for _ in range(100):\n"
                "    try:\n        c = socket.create_connection(('10.77.0.2', 7000)); break\n"
                "    except OSError:\n        time.sleep(0.05)\n"
                "c.sendall(b'link'); print(c.recv(16).decode())",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert server.wait(timeout=30) == 0
        assert client.stdout.strip() == "knil", client.stderr
        link.set_rate("1gbit")  # replaces the limit
        assert "rate 1Gbit" in link.qdisc(0)
        names = link.names
    assert not link.exists()
    ip = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin") or "ip"
    listed = subprocess.run([ip, "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
