"""zserve's persistent API: an OpenAI-compatible HTTP server over the engine.

- `app.create_app(engine)`: the FastAPI app of one engine (`/v1/completions`,
  `/v1/chat/completions`, `/v1/models`, `/health`, `/metrics`, SSE streaming).
- `async_engine.AsyncEngine`: the engine on its own thread, bounded admission.
- `router.create_router_app(replicas)`: least-loaded front end over engine processes
  started by `replicas.spawn_replicas`.
- `launch.serve(...)`: what `z serve` runs.

Modules load on first use so `import zserve.server` needs neither torch nor FastAPI.
"""

from __future__ import annotations

from typing import Any


def serve(*args: Any, **kwargs: Any) -> None:
    """Serve a model over HTTP; see `zserve.server.launch.serve`."""
    from zserve.server.launch import serve as _serve

    _serve(*args, **kwargs)


__all__ = ["serve"]
