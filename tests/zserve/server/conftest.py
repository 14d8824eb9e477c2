"""A real zserve HTTP server on loopback, shared by this directory's tests.

uvicorn runs the app in a thread of the test process (the engine on its own thread, as in
production), on a port the kernel picks. One SmolLM2 engine for the whole session.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from tests.utils.models import smollm2_dir

# small context so "prompt longer than the context" is cheap to provoke
MAX_MODEL_LEN = 512
MAX_QUEUE = 256
# many sequences per forward: the concurrency tests finish in few engine steps
ENGINE_OPTIONS = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 256, "token_budget": 512}


@dataclass
class LiveServer:
    url: str
    app: Any
    engine: Any

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Poll /health until nothing runs or waits and every KV block is free again."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            idle = h["num_running"] == 0 and h["num_waiting"] == 0 and h["queue_depth"] == 0
            if idle and h["free_blocks"] == h["total_blocks"]:
                return h
            if time.monotonic() > deadline:
                return h
            time.sleep(0.05)


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 in a daemon thread."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", ws="none", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@contextmanager
def serving(engine: Any, max_queue: int = MAX_QUEUE) -> Iterator[LiveServer]:
    """``engine``'s app served on loopback while the block runs."""
    from zserve.server.app import create_app

    app = create_app(engine, max_queue=max_queue)
    with ServerThread(app) as st:
        yield LiveServer(f"http://127.0.0.1:{st.port}", app, engine)


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    from zserve.engine import Engine

    with serving(Engine(smollm2_dir(), **ENGINE_OPTIONS)) as server:
        yield server


@pytest.fixture(scope="session")
def reference_engine() -> Any:
    """A second engine, driven directly by the test: what the server must reproduce."""
    from zserve.engine import Engine

    return Engine(smollm2_dir(), max_model_len=MAX_MODEL_LEN)


@functools.lru_cache(maxsize=1)
def _spoken_lines() -> tuple[str, ...]:
    # one play is plenty of text (reading all 38 takes seconds on a busy machine)
    from ztrain.data import clean_markdown, plays_dir

    path = sorted(plays_dir().glob("*/*.md"))[0]
    _, text = clean_markdown(path.read_text(encoding="utf-8"), path.stem)
    return tuple(
        ln.strip()
        for ln in text.splitlines()
        if len(ln.strip()) > 20 and not ln.strip().isupper() and not ln.startswith(("[", "SCENE"))
    )


def shakespeare_prompts(n: int, start: int = 0, words: int | None = None) -> list[str]:
    """``n`` real prompts: 1-4 consecutive spoken lines, or (``words``) a line's first 1..words
    words, for tests where prompt length is cost, not subject."""
    lines = _spoken_lines()
    out: list[str] = []
    i = start
    while len(out) < n:
        if words is not None:
            out.append(" ".join(lines[i % len(lines)].split()[: 1 + len(out) % words]))
            i += 1
            continue
        k = 1 + len(out) % 4
        out.append(" ".join(lines[(i + j) % len(lines)] for j in range(k)))
        i += k
    return out
