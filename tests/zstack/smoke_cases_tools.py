"""The smoke cases of `z bench`, `z quantize`/`z eval`, `z serve`, `z launch` and `z doctor`
(registered into test_cli_smoke's CASES, which imports this module)."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import threading
import urllib.request

import torch

from tests.zstack.test_cli_smoke import TIMEOUT_S, Work, smoke


@smoke("bench offload")
def _bench_offload(w: Work) -> None:
    r = w.json(
        "bench",
        "offload",
        "--modes",
        "none",
        "--preset",
        "tiny",
        "--n-layer",
        "1",
        "--n-embd",
        "64",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--seq",
        "16",
        "--world-size",
        "1",
        "--dir",
        str(w.dir),
        "--json",
    )
    assert r["benchmark"] == "offload" and list(r["modes"]) == ["none"]
    assert len(r["modes"]["none"]["losses"]) == 1 and math.isfinite(r["modes"]["none"]["losses"][0])


@smoke("bench quant")
def _bench_quant(w: Work) -> None:
    r = w.json(
        "bench",
        "quant",
        "--recipes",
        "w8",
        "--sentences",
        "4",
        "--no-smollm2",
        "--no-latency",
        "--lkd-steps",
        "0",
        "--gptq",
        "",
        "--xtc-steps",
        "0",
        "--json",
    )
    row = r["minilm"]["recipes"]["w8"]
    assert 0.9 < row["cosine"] <= 1.0 and row["linear_ratio_vs_fp16"] > 1.5


@smoke("bench zero")
def _bench_zero(w: Work) -> None:
    r = w.json("bench", "zero", "--world-size", "1", "--preset", "tiny", "--stages", "0", "--json")
    [row] = r["stages"]
    assert row["stage"] == 0 and row["within_10pct"], row


@smoke("bench zero-step")
def _bench_zero_step(w: Work) -> None:
    r = w.json(
        "bench",
        "zero-step",
        "--preset",
        "tiny",
        "--stages",
        "1",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--micro-batch",
        "1",
        "--seq",
        "16",
        "--world-size",
        "1",
        "--no-ds",
        "--json",
    )
    [row] = r["stages"]
    assert row["stage"] == 1 and row["ours"]["median_step_s"] > 0 and row["deepspeed"] is None


@smoke("quantize")
def _quantize(w: Work) -> None:
    out = w.dir / "tiny-w8"
    done = w.ok("quantize", str(w.lm), "--recipe", "w8", "--out", str(out))
    assert "smaller than fp16" in done.stdout
    manifest = json.loads((out / "zquant.json").read_text())
    assert manifest["recipe"]["name"] == "w8" and len(manifest["layers"]) == 2 * 7  # not lm_head


@smoke("eval", after="quantize")
def _eval(w: Work) -> None:
    text = w.dir / "text.txt"
    text.write_text("To be, or not to be, that is the question:\n" * 4, encoding="utf-8")
    r = w.json(
        "eval",
        str(w.dir / "tiny-w8"),
        "--ppl",
        str(text),
        "--max-tokens",
        "16",
        "--window",
        "8",
        "--json",
    )
    assert r["max_tokens"] == 16 and math.isfinite(r["ppl"]) and r["ppl"] > 1


@smoke("bench adam")
def _bench_adam(w: Work) -> None:
    r = w.json("bench", "adam", "--numel", "1000", "--steps", "1", "--warmup", "0", "--json")
    assert r["numel"] == 1000 and r["results"]["zstack_cpu_adam"]["median_step_s"] > 0


@smoke("bench adam-cuda")
def _bench_adam_cuda(w: Work) -> None:  # without a GPU (CI): the refusal that names it
    d = w.z("bench", "adam-cuda", "--hidden", "64", "--layers", "1", "--vocab", "128", "--json")
    gpu = d.returncode == 0 and json.loads(d.stdout)["results"]["torch_adam_fused"]["step_ms"] > 0
    assert gpu or (d.returncode == 2 and "needs a CUDA device" in d.stderr), d.stderr[-2000:]


@smoke("bench serve")
def _bench_serve(w: Work) -> None:
    r = w.json(
        "bench",
        "serve",
        str(w.lm),
        "--policies",
        "splitfuse,static",
        "--rates",
        "50",
        "--num-requests",
        "2",
        "--short-prompt",
        "4,8",
        "--long-prompt",
        "16,24",
        "--output-len",
        "2,3",
        "--prefix-requests",
        "2",
        "--system-prompt-tokens",
        "16",
        "--num-blocks",
        "64",
        "--token-budget",
        "32",
        "--max-num-seqs",
        "4",
        "--json",
    )
    for policy in ("splitfuse", "static"):
        assert r["results"][policy]["50.0"]["completed"] == 2, r["results"]
    assert r["workload"]["prompt_tokens"]["output"] == [2, 3]  # --output-len reached the run
    assert r["prefix_caching"]["requests"] == 2


@smoke("serve")
def _serve(w: Work) -> None:
    proc = w.start(
        "serve", str(w.lm), "--port", "0", "--num-blocks", "32", stdout=subprocess.DEVNULL
    )
    lines: list[str] = []
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:  # uvicorn logs the port it bound to stderr
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            found = re.search(r"running on (http://127\.0\.0\.1:\d+)", line, re.IGNORECASE)
            if found:
                url.append(found.group(1))
                ready.set()
        ready.set()  # EOF: it exited

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(TIMEOUT_S) and url, f"`z serve` did not start:\n{''.join(lines)}"
        body = json.dumps(
            {"model": w.lm.name, "prompt": "To be", "max_tokens": 3, "temperature": 0}
        )
        request = urllib.request.Request(
            f"{url[0]}/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            reply = json.loads(response.read())
        assert reply["object"] == "text_completion" and isinstance(reply["choices"][0]["text"], str)
        assert reply["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)  # what Ctrl+C does
        try:
            proc.wait(timeout=60)
        finally:
            proc.kill()
            proc.wait()
            reader.join(timeout=10)
            assert proc.stderr is not None
            proc.stderr.close()
            with w.lock:
                w.live.discard(proc)
    assert proc.returncode == 0, "".join(lines)[-3000:]


@smoke("launch")
def _launch(w: Work) -> None:
    script = w.dir / "rank.py"
    script.write_text(
        "import json, os, sys\n"
        "print(json.dumps({k: os.environ[k] for k in ('RANK', 'WORLD_SIZE')} | "
        "{'argv': sys.argv[1:]}))\n"
    )
    r = w.json("launch", "--nproc", "1", "--master-port", "0", str(script), "--lr", "1")
    assert r == {"RANK": "0", "WORLD_SIZE": "1", "argv": ["--lr", "1"]}


@smoke("doctor")
def _doctor(w: Work) -> None:
    r = w.json("doctor", "--json")
    assert {"packages", "python", "torch", "cpu", "problems"} <= r.keys()
    assert r["torch"]["version"] == torch.__version__


@smoke("bench io")
def _bench_io(w: Work) -> None:
    r = w.json(
        "bench",
        "io",
        "--size",
        "64KiB",
        "--block-size",
        "16KiB",
        "--queue-depth",
        "4",
        "--rounds",
        "1",
        "--no-ds",
        "--dir",
        str(w.dir),
        "--json",
    )
    assert r["ok"] is True and r["size_bytes"] == 64 << 10 and r["results"]


@smoke("bench moe")
def _bench_moe(w: Work) -> None:
    r = w.json(
        "bench",
        "moe",
        "--tokens",
        "64",
        "--d-model",
        "16",
        "--ffn",
        "32",
        "--experts",
        "4",
        "--repeats",
        "2",
        "--warmup",
        "0",
        "--no-ds",
        "--json",
    )
    assert (
        r["results"]["dropless"]["tokens_per_s"] > 0 and r["results"]["dense"]["tokens_per_s"] > 0
    )
    assert r["results"]["ds_capacity"]["tokens_per_s"] is None
    assert list(r["ratios"]) == [
        "dropless_vs_ds_capacity",
        "dropless_vs_ds_dropless",
        "dropless_vs_dense",
        "capacity_vs_ds_capacity",
    ]
    assert r["ratios"]["dropless_vs_dense"] > 0 and r["ratios"]["capacity_vs_ds_capacity"] is None


@smoke("bench comm")
def _bench_comm(w: Work) -> None:
    r = w.json(
        "bench",
        "comm",
        "--loopback",
        "--ranks",
        "2",
        "--entries",
        "adam",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--preset",
        "tiny",
        "--seq-len",
        "16",
        "--micro-batch",
        "1",
        "--json",
    )
    assert r["transport"] == "loopback"
    adam = r["runs"][0]["entries"]["adam"]
    assert adam["status"] == "ok" and adam["bytes_per_step"]["total"] > 0, adam


@smoke("bench speculative")
def _bench_speculative(w: Work) -> None:
    r = w.json(
        "bench",
        "speculative",
        "--workloads",
        "copy",
        "--concurrency",
        "1",
        "--num-prompts",
        "1",
        "--max-tokens",
        "4",
        "--modes",
        "ngram",
        "--threads",
        "1",
        "--json",
    )
    assert r["ok"] is True and r["results"]["copy/c1"]["ngram"]["identical_to_plain"]


@smoke("bench serve-quant")
def _bench_serve_quant(w: Work) -> None:
    r = w.json(
        "bench",
        "serve-quant",
        str(w.lm),
        "--recipes",
        "w8a8",
        "--decode-tokens",
        "2",
        "--concurrent",
        "2",
        "--prompt-tokens",
        "8",
        "--ppl-tokens",
        "256",
        "--threads",
        "1",
        "--quant-dir",
        str(w.dir / "serve-quant"),
        "--json",
    )
    assert r["rows"]["w8a8"]["kernels"] == ["int8_linear"] and r["rows"]["fp32"]["ppl"] > 0


@smoke("bench serve-offload")
def _bench_serve_offload(w: Work) -> None:
    # 130K: one of the tiny LM's two layers (a 4096-aligned blob); both stream through it
    r = w.json(
        "bench",
        "serve-offload",
        str(w.lm),
        "--weights-budget",
        "130K",
        "--batches",
        "1,2",
        "--max-tokens",
        "2",
        "--threads",
        "1",
        "--peers",
        "",
        "--offload-dir",
        str(w.dir),
        "--json",
    )
    assert r["ours"]["stream"]["streamed_layers"] == 2 and r["disk"]["gb_per_s"] > 0
    assert [row["batch"] for row in r["rows"]] == [1, 2] and r["rss"]["peak_rss"] > 0


@smoke("bench efficiency", after="train")  # reads the tokenizer `train` cached
def _bench_efficiency(w: Work) -> None:
    r = w.json(
        "bench",
        "efficiency",
        "--steps",
        "2",
        "--evals",
        "1",
        "--seq-len",
        "16",
        "--micro-batch",
        "2",
        "--min-seqlen",
        "8",
        "--no-stability",
        "--json",
    )
    c = r["curriculum"]
    assert c["baseline"]["tokens"] == 2 * 2 * 16 and c["curriculum"]["tokens"] >= 64


@smoke("bench hybrid")
def _bench_hybrid(w: Work) -> None:
    r = w.json(
        "bench",
        "hybrid",
        str(w.lm),
        "--num-prompts",
        "2",
        "--max-tokens",
        "4",
        "--no-zero3-baseline",
        "--json",
    )
    assert r["generated_tokens"] == 8 and r["rows"]["hf_generate"]["tokens_per_s"] > 0


@smoke("bench hf-trainer")
def _bench_hf_trainer(w: Work) -> None:
    args = ["--model", "tiny", "--world-size", "1", "--modes", "zero2", "--steps", "1", "--json"]
    r = w.json("bench", "hf-trainer", *args, "--warmup", "0", "--micro-batch", "1", "--seq", "8")
    row = r["modes"]["zero2"]
    assert r["world_size"] == 1 and row["zcore"]["step_s"] > 0 and row["ddp"]["step_s"] > 0, r
    # DeepSpeed is not installed in the test environment: said, and DDP is the baseline
    assert "deepspeed" in r["deepspeed_unavailable"] and row["baseline"] == "ddp", r
    assert row["step_ratio"] == row["vs_ddp"]["step_ratio"] > 0, r
