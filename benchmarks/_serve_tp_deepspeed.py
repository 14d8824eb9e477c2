"""The DeepSpeed AutoTP peer of `z bench serve --tp N`: one rank of
``deepspeed.init_inference(model, tensor_parallel={"tp_size": N})`` on the CPU accelerator over
gloo (the environment gives RANK, WORLD_SIZE, MASTER_ADDR/PORT; DeepSpeed is installed beside,
on PYTHONPATH). Every rank runs the same greedy ``generate`` calls (its all-reduces need
them all); rank 0 prints one JSON line.

Timed as the zserve contenders are: batch-1 decode tokens/s from ``max_new_tokens`` D and 1
(the difference is the D - 1 decode steps), and ``concurrent`` same-length prompts in one
batch (no padding): output tokens / wall time, prefill included.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any


def main(a: dict[str, Any]) -> dict[str, Any] | None:
    import torch

    torch.set_num_threads(a["threads"])
    import deepspeed  # type: ignore[import-not-found]
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a["model_dir"], dtype=torch.float32).eval()
    engine = deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": int(os.environ["WORLD_SIZE"])},
        dtype=torch.float32,
        replace_with_kernel_inject=False,
    )
    m = engine.module
    load_s = time.perf_counter() - t0
    d = a["decode_tokens"]

    def generate(ids: list[list[int]], new: int) -> tuple[float, list[int]]:
        x = torch.tensor(ids)
        t = time.perf_counter()
        with torch.no_grad():
            out = m.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t, out[0, x.shape[1] :].tolist()

    prompts = a["prompts"]
    decode, tokens = [], []
    for _ in range(a["rounds"]):
        first, _ = generate(prompts[:1], 1)
        whole, tokens = generate(prompts[:1], d)
        decode.append((d - 1) / max(whole - first, 1e-9))
    waves = []
    batch = prompts[1 : 1 + a["concurrent"]]
    for _ in range(a["rounds"]):
        took, _ = generate(batch, d)
        waves.append(len(batch) * d / took)
    if int(os.environ["RANK"]) != 0:
        return None
    return {
        "tp": int(os.environ["WORLD_SIZE"]),
        "threads": a["threads"],
        "load_s": load_s,
        "batch1_tokens_per_s": statistics.median(decode),
        "batch1_tokens": tokens,
        "concurrent_tokens_per_s": statistics.median(waves),
        "deepspeed": deepspeed.__version__,
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    if result is not None:
        print(json.dumps(result), flush=True)
