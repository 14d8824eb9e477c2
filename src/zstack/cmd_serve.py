"""`z` commands of zserve. Imports only typer at load time; zserve loads when a command runs."""

from __future__ import annotations

import typer


def serve(
    model_dir: str = typer.Argument(
        ..., help="Hugging Face model directory (config.json + safetensors)."
    ),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port of the HTTP server."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (`0.0.0.0`: all)."),
    replicas: int = typer.Option(
        1, "--replicas", min=1, help="Engine processes behind one least-loaded front end."
    ),
    max_queue: int = typer.Option(
        256, "--max-queue", min=1, help="Requests in flight per engine; beyond it, HTTP 429."
    ),
    policy: str = typer.Option(
        "splitfuse", "--policy", help="Scheduler: `splitfuse`, `prefill-first` or `static`."
    ),
    token_budget: int | None = typer.Option(
        None, "--token-budget", min=1, help="Tokens per forward (splitfuse)."
    ),
    max_num_seqs: int | None = typer.Option(
        None, "--max-num-seqs", min=1, help="Most sequences alive at once."
    ),
    block_size: int | None = typer.Option(None, "--block-size", min=1, help="Tokens per KV block."),
    num_blocks: int | None = typer.Option(None, "--num-blocks", min=1, help="KV-cache blocks."),
    kv_cache_bytes: int | None = typer.Option(
        None, "--kv-cache-bytes", min=1, help="KV-cache size (instead of --num-blocks)."
    ),
    prefix_caching: bool | None = typer.Option(
        None, "--prefix-caching/--no-prefix-caching", help="Reuse KV blocks of shared prefixes."
    ),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", min=2, help="Longest prompt + output in tokens."
    ),
    dtype: str | None = typer.Option(None, "--dtype", help="`float32`, `bfloat16` or `float16`."),
    device: str | None = typer.Option(None, "--device", help="`cpu`, `cuda`, `cuda:1`..."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
) -> None:
    """Serve MODEL_DIR with an OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`)."""
    from pydantic import ValidationError

    from zserve.config import EngineConfig
    from zserve.server import serve as run_server

    options = {
        "policy": policy,
        "token_budget": token_budget,
        "max_num_seqs": max_num_seqs,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "kv_cache_bytes": kv_cache_bytes,
        "prefix_caching": prefix_caching,
        "max_model_len": max_model_len,
        "dtype": dtype,
        "device": device,
    }
    try:
        config = EngineConfig(**{k: v for k, v in options.items() if v is not None})
    except ValidationError as exc:
        typer.echo(f"error: bad engine option: {exc}", err=True)
        raise typer.Exit(2) from exc
    run_server(
        model_dir,
        host=host,
        port=port,
        replicas=replicas,
        max_queue=max_queue,
        config=config,
        log_level=log_level,
    )


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add this module's commands to `z` and `z bench`."""
    app.command("serve")(serve)
