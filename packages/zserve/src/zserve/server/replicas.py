"""Engine worker processes for `--replicas N` (`zserve.server.launch` puts the router in front).

The parent binds each worker's loopback socket itself (port 0: the kernel
picks a free one, no race) and hands the listening descriptor to the child,
which runs the one-engine app of `zserve.server.app` on it. A worker exits
when its parent does, so a killed front end leaves no orphans.

Run a worker by hand: ``python -m zserve.server.replicas --fd N --model-dir DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class Replica:
    """One engine worker process and the router's view of it."""

    index: int
    host: str
    port: int
    process: subprocess.Popen
    healthy: bool = False
    in_flight: int = 0
    routed: int = 0
    """Requests the router has sent here (retries included)."""
    last_error: str = ""
    started_at: float = field(default_factory=time.time)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def process_alive(self) -> bool:
        return self.process.poll() is None

    def returncode(self) -> int | None:
        return self.process.poll()

    def describe(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "pid": self.pid,
            "url": self.url,
            "port": self.port,
            "healthy": self.healthy,
            "alive": self.process_alive(),
            "in_flight": self.in_flight,
            "routed": self.routed,
            "last_error": self.last_error,
        }


def replica_cpus(n: int) -> list[list[int]] | None:
    """The cores each of ``n`` replicas runs on: the cores this process may use, cut into
    ``n`` contiguous slices as even as whole cores allow; None (every replica on every core)
    where there are fewer cores than replicas or the OS sets no affinity. A replica's torch
    and znative threads, and a tensor-parallel replica's ranks
    (:func:`zserve.tp.runner.rank_cpus`), then share out its own slice, not the first cores
    of the machine."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < n:
        return None
    bounds = [len(allowed) * i // n for i in range(n + 1)]
    return [allowed[bounds[i] : bounds[i + 1]] for i in range(n)]


def spawn_replicas(
    model_dir: str | Path,
    n: int,
    config_json: str = "{}",
    max_queue: int = 256,
    host: str = "127.0.0.1",
) -> list[Replica]:
    """Start ``n`` engine workers on free loopback ports (not yet ready; see `wait_ready`),
    each on its own cores where there are enough (:func:`replica_cpus`)."""
    if n < 1:
        raise ValueError(f"replicas must be >= 1, got {n}")
    cpus = replica_cpus(n)
    replicas: list[Replica] = []
    for i in range(n):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(2048)  # connections queue here until the worker accepts them
        sock.set_inheritable(True)
        cmd = [
            sys.executable,
            "-m",
            "zserve.server.replicas",
            "--fd",
            str(sock.fileno()),
            "--model-dir",
            str(model_dir),
            "--config",
            config_json,
            "--max-queue",
            str(max_queue),
            "--parent-pid",
            str(os.getpid()),
        ]
        if cpus is not None:
            cmd += ["--cpus", ",".join(map(str, cpus[i]))]
        proc = subprocess.Popen(cmd, pass_fds=(sock.fileno(),))
        port = sock.getsockname()[1]
        sock.close()  # the child holds its own copy
        replicas.append(Replica(index=i, host=host, port=port, process=proc))
    return replicas


def wait_ready(replicas: list[Replica], timeout_s: float = 600.0) -> None:
    """Block until every replica answers `/health` with 200; raise if one exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    with httpx.Client(timeout=5.0) as client:
        while pending:
            for rep in list(pending):
                if not rep.process_alive():
                    raise RuntimeError(
                        f"replica {rep.index} (pid {rep.pid}) exited with code "
                        f"{rep.returncode()} while loading; its stderr above says why"
                    )
                try:
                    if client.get(f"{rep.url}/health").status_code == 200:
                        rep.healthy = True
                        pending.remove(rep)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"replicas {[r.index for r in pending]} not healthy after {timeout_s:.0f} s"
                )
            if pending:
                time.sleep(0.2)


def stop_replicas(replicas: list[Replica], grace_s: float = 10.0) -> None:
    """SIGTERM every worker, then SIGKILL the ones still there after ``grace_s``."""
    for rep in replicas:
        if rep.process_alive():
            rep.process.terminate()
    deadline = time.monotonic() + grace_s
    for rep in replicas:
        try:
            rep.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rep.process.kill()
            rep.process.wait()


def _exit_with_parent(parent_pid: int) -> None:
    # a worker whose front end died (even by SIGKILL) must not hold its model and port forever
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5.0)
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="zserve-parent-watch", daemon=True).start()


def worker_main(argv: list[str] | None = None) -> None:
    """Entry point of one engine worker process (started by `spawn_replicas`)."""
    parser = argparse.ArgumentParser(prog="python -m zserve.server.replicas")
    parser.add_argument("--fd", type=int, required=True, help="inherited listening socket")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--config", default="{}", help="EngineConfig as JSON")
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--cpus", default=None, help="comma-separated cores to run on")
    args = parser.parse_args(argv)
    if args.cpus:  # before torch starts its threads: they follow this process's cores
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    if args.parent_pid is not None:
        _exit_with_parent(args.parent_pid)

    import uvicorn

    from zserve.config import EngineConfig
    from zserve.engine import make_engine
    from zserve.server.app import create_app

    config = EngineConfig(**json.loads(args.config))
    app = create_app(make_engine(args.model_dir, config), max_queue=args.max_queue)
    sock = socket.socket(fileno=args.fd)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, ws="none"))
    server.run(sockets=[sock])


if __name__ == "__main__":
    worker_main()
