"""`serve()`, the body of `z serve`: one engine in this process, or `replicas` engine
worker processes (`zserve.server.replicas`) behind the least-loaded router
(`zserve.server.router`).

`zserve.server.serve` imports this module only when called, so `import zserve.server`
stays free of torch, FastAPI and uvicorn.
"""

from __future__ import annotations

from pathlib import Path

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
        app = create_app(make_engine(model_dir, config), max_queue=max_queue)
        uvicorn.run(app, host=host, port=port, log_level=log_level, ws="none")
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
