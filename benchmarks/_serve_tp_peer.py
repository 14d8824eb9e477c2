"""A peer of `z bench serve --tp N`, one rank of it over gloo (the environment gives RANK,
WORLD_SIZE, MASTER_ADDR/PORT):

* ``deepspeed``: ``deepspeed.init_inference(model, tensor_parallel={"tp_size": N})`` on its
  CPU accelerator (DeepSpeed installed beside, on PYTHONPATH);
* ``transformers``: ``from_pretrained(..., tp_plan="auto")``, transformers' own tensor
  parallelism (DTensor under the model's ``base_model_tp_plan``).

Every rank runs the same greedy ``generate`` calls (their all-reduces need them all); rank 0
prints one JSON line.

Timed as the zserve contenders are: batch-1 decode tokens/s over the D - 1 decode steps after
the first token (the times a streamer sees each token come out), and ``concurrent``
same-length prompts in one batch (no padding): output tokens / wall time, prefill included.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any


def _deepspeed(model_dir: str) -> tuple[Any, str]:
    import deepspeed  # type: ignore[import-not-found]
    import torch
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": int(os.environ["WORLD_SIZE"])},
        dtype=torch.float32,
        replace_with_kernel_inject=False,
    )
    return engine.module, deepspeed.__version__


def _transformers(model_dir: str) -> tuple[Any, str]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    return model.eval(), transformers.__version__


def main(a: dict[str, Any]) -> dict[str, Any] | None:
    import torch

    torch.set_num_threads(a["threads"])
    t0 = time.perf_counter()
    m, version = {"deepspeed": _deepspeed, "transformers": _transformers}[a["peer"]](a["model_dir"])
    load_s = time.perf_counter() - t0
    d = a["decode_tokens"]

    class Clock:
        """A ``generate`` streamer: the time each step's tokens came out (the first call
        is the prompt)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def generate(ids: list[list[int]], new: int) -> tuple[float, list[int], list[float]]:
        x = torch.tensor(ids)
        clock = Clock()
        t = time.perf_counter()
        with torch.no_grad():
            out = m.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                streamer=clock if x.shape[0] == 1 else None,  # transformers streams batch 1
            )
        return time.perf_counter() - t, out[0, x.shape[1] :].tolist(), clock.times

    prompts = a["prompts"]
    decode, tokens = [], []
    for _ in range(a["rounds"]):
        _, tokens, times = generate(prompts[:1], d)
        # times: the prompt, then one per new token; decode = the steps after the first token
        decode.append((d - 1) / (times[-1] - times[1]))
    waves = []
    batch = prompts[1 : 1 + a["concurrent"]]
    for _ in range(a["rounds"]):
        took, _, _ = generate(batch, d)
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
        "peer": a["peer"],
        "version": version,
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    if result is not None:
        print(json.dumps(result), flush=True)
