"""One contender of `z bench serve --tp N`, in a process of its own (its thread settings are
its own): ``python _serve_tp_child.py JSON`` prints one JSON line.

The engine serves greedy requests of ``prompt_tokens`` Shakespeare tokens and
``decode_tokens`` outputs (EOS ignored), prefix caching off so every round computes its
prompts: ``rounds`` batch-1 requests (the decode steps after the first token timed one by
one) and ``rounds`` waves of ``concurrent`` requests added at once (tokens out / wall time,
prefill included).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any


def main(a: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(a["threads"])
    from zserve.engine import Engine
    from zserve.sampling import SamplingParams

    p, d, c = a["prompt_tokens"], a["decode_tokens"], a["concurrent"]
    length = p + d + 8
    t0 = time.perf_counter()
    engine = Engine(
        a["model_dir"],
        tp=a["tp"],
        tp_collectives=a.get("collectives", "p2p"),
        cpu_idle=a.get("cpu_idle", "auto"),
        dtype=a["dtype"],
        max_model_len=length,
        max_num_seqs=c,
        token_budget=max(256, p),
        num_blocks=c * -(-length // 16) + 4,
        prefix_caching=False,
    )
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=d, temperature=0, ignore_eos=True)
    prompts = a["prompts"]
    out: dict[str, Any] = {"tp": a["tp"], "threads": a["threads"], "load_s": load_s}
    out["cpu_idle"] = "poll" if engine.polls_idle_cores else "halt"
    try:
        decode, tokens = [], None
        for r in range(a["rounds"]):
            engine.add_request(f"b{r}", prompts[0], params)
            steps, got = [], []
            while engine.has_unfinished():
                t = time.perf_counter()
                outs = engine.step()
                dt = time.perf_counter() - t
                if got:  # after the first token: a decode step
                    steps.append(dt)
                for o in outs:
                    got += o.token_ids
            decode.append((len(steps)) / sum(steps))
            tokens = got
        out["batch1_tokens_per_s"] = statistics.median(decode)
        out["batch1_step_ms"] = 1e3 / out["batch1_tokens_per_s"]
        out["batch1_tokens"] = tokens
        waves = []
        for r in range(a["rounds"]):
            for i in range(c):
                engine.add_request(f"c{r}-{i}", prompts[1 + i], params)
            t = time.perf_counter()
            n = 0
            while engine.has_unfinished():
                n += sum(len(o.token_ids) for o in engine.step())
            waves.append(n / (time.perf_counter() - t))
        out["concurrent_tokens_per_s"] = statistics.median(waves)
        out["concurrent"] = c
    finally:
        engine.close()
    return out


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    os.environ.setdefault("ZNATIVE_NUM_THREADS", str(args["threads"]))
    print(json.dumps(main(args)), flush=True)
