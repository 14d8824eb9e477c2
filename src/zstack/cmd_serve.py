"""`z` commands of zserve. Imports only typer at load time; zserve loads when a command runs."""

from __future__ import annotations

import typer


def serve(
    model_dir: str = typer.Argument(
        ...,
        help="Hugging Face model directory (config.json + safetensors), or a `z quantize` "
        "output directory (served through zquant's native kernels).",
    ),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port of the HTTP server."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (`0.0.0.0`: all)."),
    replicas: int = typer.Option(
        1, "--replicas", min=1, help="Engine processes behind one least-loaded front end."
    ),
    max_queue: int = typer.Option(
        256, "--max-queue", min=1, help="Requests in flight per engine; beyond it, HTTP 429."
    ),
    tp: int = typer.Option(
        1, "--tp", min=1, help="Tensor-parallel ranks per engine (processes, gloo)."
    ),
    tp_collectives: str | None = typer.Option(
        None,
        "--tp-collectives",
        help="--tp: what carries the ranks' all-reduces: `p2p` (torch.distributed sends and "
        "receives, the default) or `gloo` (its collectives).",
    ),
    cpu_idle: str | None = typer.Option(
        None,
        "--cpu-idle",
        help="Idle cores while requests are in flight: `poll` (Linux CPU latency QoS at 0 us;"
        " root), `halt`, or `auto` (the default: `poll` at --tp >= 2 where allowed).",
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
    speculative: str | None = typer.Option(
        None,
        "--speculative",
        help="Speculative decoding of greedy requests: `ngram` or `self-draft`.",
    ),
    num_speculative_tokens: int | None = typer.Option(
        None, "--num-speculative-tokens", min=1, help="Draft tokens verified per step."
    ),
    draft_layers: int | None = typer.Option(
        None, "--draft-layers", min=1, help="`self-draft`: layers of the draft model."
    ),
    prompt_lookup_max: int | None = typer.Option(
        None, "--prompt-lookup-max", min=1, help="`ngram`: longest n-gram matched."
    ),
    prompt_lookup_min: int | None = typer.Option(
        None, "--prompt-lookup-min", min=1, help="`ngram`: shortest n-gram matched."
    ),
    weights_budget: str | None = typer.Option(
        None,
        "--weights-budget",
        help="Decoder-layer weights held in memory (`64M`, `1.5G`); the rest stream per step.",
    ),
    offload: str | None = typer.Option(
        None, "--offload", help="Where layers beyond the budget live: `cpu` or `nvme`."
    ),
    offload_dir: str | None = typer.Option(
        None, "--offload-dir", help="`nvme`: the directory of the swap file (O_DIRECT reads)."
    ),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
) -> None:
    """Serve MODEL_DIR with an OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`)."""
    from pydantic import ValidationError

    from zserve.config import EngineConfig
    from zserve.server import serve as run_server

    if tp_collectives is not None and tp_collectives not in ("p2p", "gloo"):
        typer.echo(
            f"error: --tp-collectives {tp_collectives!r} is not one of `p2p` (point-to-point "
            "sends and receives, the default) or `gloo` (gloo's collectives); pass one of them",
            err=True,
        )
        raise typer.Exit(2)
    if tp_collectives is not None and tp < 2:
        typer.echo(
            f"error: --tp-collectives {tp_collectives} is for tensor-parallel ranks, but --tp "
            f"is {tp}: add --tp N (N >= 2) or drop --tp-collectives",
            err=True,
        )
        raise typer.Exit(2)
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
        "speculative": speculative,
        "num_speculative_tokens": num_speculative_tokens,
        "draft_layers": draft_layers,
        "prompt_lookup_max": prompt_lookup_max,
        "prompt_lookup_min": prompt_lookup_min,
        "weights_budget": weights_budget,
        "offload": offload,
        "offload_dir": offload_dir,
        "tp": tp,
        "tp_collectives": tp_collectives,
        "cpu_idle": cpu_idle,
    }
    try:
        config = EngineConfig(**{k: v for k, v in options.items() if v is not None})
    except ValidationError as exc:
        typer.echo(f"error: bad engine option: {exc}", err=True)
        raise typer.Exit(2) from exc
    from zserve.cpu_idle import CpuIdleError
    from zserve.offload import OffloadDirError, WeightsBudgetError
    from zserve.tp.plan import TPPlanError

    try:
        run_server(
            model_dir,
            host=host,
            port=port,
            replicas=replicas,
            max_queue=max_queue,
            config=config,
            log_level=log_level,
        )
    except (WeightsBudgetError, OffloadDirError, TPPlanError, CpuIdleError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


def bench_serve(
    model_dir: str | None = typer.Argument(
        None, help="HF model directory (default: SmolLM2-135M-Instruct from `make setup`)."
    ),
    policies: str = typer.Option(
        "splitfuse,prefill-first,static", "--policies", help="Comma-separated policies to compare."
    ),
    rates: str = typer.Option("0.5,1.0,2.0", "--rates", help="Poisson arrival rates, req/s."),
    num_requests: int = typer.Option(12, "--num-requests", min=1, help="Requests per rate."),
    token_budget: int | None = typer.Option(
        None, "--token-budget", min=1, help="Tokens per forward (64; with --compare 256)."
    ),
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", min=1),
    num_blocks: int = typer.Option(1024, "--num-blocks", min=1, help="KV-cache blocks."),
    short_prompt: str = typer.Option("8,48", "--short-prompt", help="MIN,MAX prompt tokens."),
    long_prompt: str = typer.Option("384,768", "--long-prompt", help="MIN,MAX long prompt."),
    long_fraction: float = typer.Option(0.25, "--long-fraction", min=0.0, max=1.0),
    output_len: str = typer.Option("16,48", "--output-len", help="MIN,MAX output tokens."),
    sla_ttft_units: float = typer.Option(
        40.0, "--sla-ttft-units", help="SLA: TTFT bound, in forwards of token_budget tokens."
    ),
    sla_rate_per_unit: float = typer.Option(
        0.5, "--sla-rate-per-unit", help="SLA: tokens per forward-time held at every token."
    ),
    sla_ema_span: int = typer.Option(
        16, "--sla-ema-span", min=1, help="SLA: EMA span of the inter-token latency check."
    ),
    prefix_requests: int = typer.Option(6, "--prefix-requests", min=0),
    system_prompt_tokens: int = typer.Option(384, "--system-prompt-tokens", min=1),
    threads: int = typer.Option(1, "--threads", min=1, help="torch threads."),
    max_run_s: float = typer.Option(120.0, "--max-run-s", help="Bound on one policy and rate run."),
    seed: int = typer.Option(0, "--seed"),
    compare: str | None = typer.Option(
        None,
        "--compare",
        help="`llama.cpp`: instead of the workload, zserve vs llama-cpp-python (`make llama-cpp`)"
        " on the same weights: prefill, batch-1 decode and --concurrent tokens/s per precision.",
    ),
    precisions: str = typer.Option(
        "fp32,bf16,w8a8,w4",
        "--precisions",
        help="--compare pairs (fp32,bf16,w8a8,w4,w4a8; w8a8-fp32-head,w4-fp32-head keep an fp32 head).",
    ),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", min=1, help="--compare prompt."),
    decode_tokens: int = typer.Option(32, "--decode-tokens", min=2, help="--compare outputs."),
    concurrent: int = typer.Option(16, "--concurrent", min=1, help="--compare requests at once."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="--compare timed rounds."),
    gguf_dir: str | None = typer.Option(None, "--gguf-dir", help="--compare GGUF files' dir."),
    simd: str | None = typer.Option(
        None,
        "--simd",
        help="--compare at `avx2` on any x86 host: znative, torch and its GEMM libraries forced"
        " to AVX2, llama.cpp from `make llama-cpp-avx2`.",
    ),
    tp: int | None = typer.Option(
        None,
        "--tp",
        min=2,
        help="Instead of the workload: tp=N (one thread a rank) vs tp=1 (N threads), batch-1"
        " decode and --concurrent tokens/s.",
    ),
    tp_recipes: str = typer.Option(
        "",
        "--tp-recipes",
        help="--tp: also these zquant recipes' directories at tp=1 vs tp=N (e.g. w8a8,w4).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """Open-loop serving workload per policy and rate: tokens/s, TTFT/ITL percentiles,
    SLA effective throughput; and prefix caching's effect on TTFT. With --compare llama.cpp:
    zserve vs llama-cpp-python at matched precision, in the same run. With --tp N: tensor-
    parallel serving against one process on the same cores."""
    from zstack.bench import run_benchmark

    if tp is not None:
        options = dict(prompt_tokens=prompt_tokens, decode_tokens=decode_tokens)
        raise typer.Exit(
            run_benchmark(
                "serve_tp",
                json_out,
                model_dir=model_dir,
                tp=tp,
                concurrent=concurrent,
                repeats=repeats,
                quantized=tp_recipes,
                **options,
            )
        )
    if compare is not None:
        raise typer.Exit(
            run_benchmark(
                "serve",
                json_out,
                model_dir=model_dir,
                threads=threads,
                compare=compare,
                compare_options={
                    "precisions": precisions,
                    "prompt_tokens": prompt_tokens,
                    "decode_tokens": decode_tokens,
                    "concurrent": concurrent,
                    "token_budget": token_budget or 256,
                    "repeats": repeats,
                    "gguf_dir": gguf_dir,
                    "simd": simd,
                },
            )
        )

    raise typer.Exit(
        run_benchmark(
            "serve",
            json_out,
            model_dir=model_dir,
            policies=policies,
            rates=rates,
            num_requests=num_requests,
            seed=seed,
            token_budget=token_budget or 64,
            max_num_seqs=max_num_seqs,
            num_blocks=num_blocks,
            short_prompt=short_prompt,
            long_prompt=long_prompt,
            long_fraction=long_fraction,
            output_len=output_len,
            sla_ttft_units=sla_ttft_units,
            sla_rate_per_unit=sla_rate_per_unit,
            sla_ema_span=sla_ema_span,
            prefix_requests=prefix_requests,
            system_prompt_tokens=system_prompt_tokens,
            threads=threads,
            max_run_s=max_run_s,
        )
    )


def bench_serve_quant(
    model_dir: str | None = typer.Argument(
        None, help="HF model directory (default: SmolLM2-135M-Instruct from `make setup`)."
    ),
    recipes: str = typer.Option(
        "w8a8,w6a16,w4",
        "--recipes",
        help="zquant recipes served against fp32 (w8a8,w6a16,w4,w4a8).",
    ),
    quant_dir: str | None = typer.Option(
        None, "--quant-dir", help="Where the quantized directories go (reused when present)."
    ),
    decode_tokens: int = typer.Option(32, "--decode-tokens", min=2, help="Tokens per request."),
    concurrent: int = typer.Option(16, "--concurrent", min=1, help="Requests added at once."),
    prompt_tokens: int = typer.Option(64, "--prompt-tokens", min=1),
    token_budget: int = typer.Option(256, "--token-budget", min=1, help="Tokens per forward."),
    ppl_tokens: int = typer.Option(1024, "--ppl-tokens", min=256, help="Perplexity tokens."),
    threads: int = typer.Option(2, "--threads", min=1, help="torch threads."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """fp32 vs `z quantize` directories served by zserve: batch-1 decode and concurrent
    tokens/s, perplexity and size per recipe, in one run."""
    from zstack.bench import load, run_benchmark

    try:
        load("serve_quant").check_recipes(recipes)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(
        run_benchmark(
            "serve_quant",
            json_out,
            model_dir=model_dir,
            recipes=recipes,
            quant_dir=quant_dir,
            decode_tokens=decode_tokens,
            concurrent=concurrent,
            prompt_tokens=prompt_tokens,
            token_budget=token_budget,
            ppl_tokens=ppl_tokens,
            threads=threads,
        )
    )


def bench_serve_offload(
    model_dir: str | None = typer.Argument(
        None, help="HF model directory (default: SmolLM2-135M-Instruct from `make setup`)."
    ),
    weights_budget: str = typer.Option(
        "1/4", "--weights-budget", help="A fraction of the layer weights (`1/4`) or a SIZE."
    ),
    offload: str = typer.Option("nvme", "--offload", help="`nvme` or `cpu`."),
    offload_dir: str | None = typer.Option(
        None, "--offload-dir", help="`nvme`: where the swap file goes (default: /tmp)."
    ),
    batches: str = typer.Option("1,16", "--batches", help="Comma-separated batch sizes."),
    prompt_len: int = typer.Option(16, "--prompt-len", min=1),
    max_tokens: int = typer.Option(8, "--max-tokens", min=1, help="Decode steps timed."),
    threads: int = typer.Option(2, "--threads", min=1, help="torch threads per contender."),
    prefetch: int = typer.Option(1, "--prefetch", min=1, max=8, help="Layers fetched ahead."),
    peers: str = typer.Option("accelerate,llama.cpp", "--peers", help="Peers to run beside."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """zserve under a weight budget vs the resident server and the peers: tokens/s, step
    latency, IO-wait share, the disk's O_DIRECT rate and the share of its limit reached."""
    from zstack.bench import run_benchmark

    options = dict(budget=weights_budget, offload=offload, offload_dir=offload_dir)
    raise typer.Exit(
        run_benchmark(
            "serve_offload",
            json_out,
            model_dir=model_dir,
            batches=batches,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            threads=threads,
            prefetch=prefetch,
            peers=peers,
            **options,
        )
    )


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add this module's commands to `z` and `z bench`."""
    app.command("serve")(serve)
    bench_app.command("serve")(bench_serve)
    bench_app.command("serve-quant")(bench_serve_quant)
    bench_app.command("serve-offload")(bench_serve_offload)
