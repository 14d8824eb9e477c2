"""`serve()`, the body of `z serve`: one engine in this process, or `replicas` engine
worker processes (`zserve.server.replicas`) behind the least-loaded router
(`zserve.server.router`).

`zserve.server.serve` imports this module only when called, so `import zserve.server`
stays free of torch, FastAPI and uvicorn.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from zserve.config import EngineConfig
from zserve.engine import make_engine
from zserve.server.app import create_app
from zserve.server.replicas import spawn_replicas, stop_replicas, wait_ready
from zserve.server.router import create_router_app


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    replicas: int = 1,
    max_queue: int = 256,
    config: EngineConfig | None = None,
    log_level: str = "info",
) -> None:
    """Serve ``model_dir`` over HTTP until interrupted: one engine in-process, or ``replicas``
    engine processes behind a least-loaded router."""
    config = config or EngineConfig()
    if replicas == 1:
        engine = make_engine(model_dir, config)
        try:
            app = create_app(engine, max_queue=max_queue)
            _run_until_fatal(app, host, port, log_level)
        finally:
            getattr(engine, "close", lambda: None)()  # tensor-parallel ranks
        return
    workers = spawn_replicas(model_dir, replicas, config.model_dump_json(), max_queue)
    try:
        wait_ready(workers)
        pids = ", ".join(f"{r.index}: pid {r.pid} port {r.port}" for r in workers)
        print(f"zserve: {replicas} replicas ready ({pids})", flush=True)
        app = create_router_app(workers)
        uvicorn.run(app, host=host, port=port, log_level=log_level, ws="none")
    finally:
        stop_replicas(workers)


def _run_until_fatal(app: Any, host: str, port: int, log_level: str) -> None:
    """uvicorn until interrupted, or until the engine stops for good (a tensor-parallel
    rank died): then the server shuts down and the process exits naming the error."""
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, ws="none")
    )
    aengine = app.state.async_engine

    def watch() -> None:
        while not server.should_exit:
            if aengine.fatal_error is not None:
                time.sleep(1.0)  # the failed requests' responses go out first
                server.should_exit = True
                return
            time.sleep(0.2)

    threading.Thread(target=watch, name="zserve-fatal-watch", daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl+C it shut down on, as uvicorn.run does
        pass
    if aengine.fatal_error is not None:
        raise SystemExit(f"zserve: the engine stopped: {aengine.fatal_error}")
