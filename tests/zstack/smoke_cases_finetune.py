"""The smoke case of `z finetune` (registered into test_cli_smoke's CASES, which imports this
module): one step of full fine-tuning of the tiny LLaMA on two JSONL lines, text and chat."""

from __future__ import annotations

import json

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
