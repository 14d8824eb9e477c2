"""The smoke case of `z finetune` (registered into test_cli_smoke's CASES, which imports this
module): one step of full fine-tuning of the tiny LLaMA on two JSONL lines, text and chat, on
one process and with `--nproc 2 --tp 2` (the layers cut over two ranks, `final/` whole)."""

from __future__ import annotations

import json

from safetensors import safe_open

from tests.zstack.test_cli_smoke import Work, smoke


@smoke("finetune")
def _finetune(w: Work) -> None:
    data = w.dir / "finetune.jsonl"
    lines = [
        {"text": "Shall I compare thee to a summer's day?"},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi!"}]},
    ]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = w.dir / "finetune-run"
    args = ["--out", str(out), "--seq-len", "16", "--micro-batch", "2", "--max-steps", "1"]
    done = w.ok("finetune", str(w.lm), str(data), *args)
    assert "done: 1 steps" in done.stdout and f"`z serve {out / 'final'}`" in done.stdout, (
        done.stdout
    )
    assert (out / "final" / "model.safetensors").is_file() and (out / "loss.png").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] and records[0]["loss"] > 0
    tp_out = w.dir / "finetune-tp"
    tp_args = ["--out", str(tp_out), *args[2:], "--nproc", "2", "--tp", "2"]
    done = w.ok("finetune", str(w.lm), str(data), *tp_args)
    assert "2 rank(s) (tp 2 x dp 1)" in done.stdout and "done: 1 steps" in done.stdout, done.stdout
    with safe_open(str(tp_out / "final" / "model.safetensors"), "pt") as f:  # gathered whole
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [64, 64]
