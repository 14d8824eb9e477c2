"""`z finetune`'s data: a local JSONL file of plain text or chat conversations, as token rows.

Each non-blank line is one JSON object, one training example:

    {"text": "Any plain text."}
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}

A `messages` line is rendered with the tokenizer's chat template (`apply_chat_template`, the
model directory's own), then tokenized as text. Every example becomes one row of `seq_len`
tokens: cut there if longer, padded (`attention_mask` 0, label -100) if shorter, so every batch
has one shape and padding never counts in the loss. Any line that is not such an object is a
:class:`FinetuneError` naming the file, the line number and what was wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IGNORE = -100
"""The label of a padding position (transformers' causal-LM loss skips it)."""


class FinetuneError(ValueError):
    """Input `z finetune` cannot use; the message names the file, value and fix."""


@dataclass(frozen=True)
class Rows:
    """The examples as fixed-length rows, and what they hold."""

    rows: list[dict[str, Any]]
    """`input_ids`, `attention_mask`, `labels`: int64 tensors of `seq_len`."""
    tokens: int
    """Real (non-padding) tokens over all rows."""
    truncated: int
    """Examples longer than `seq_len` (cut)."""


def read_examples(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The JSON object of every non-blank line; a :class:`FinetuneError` names the first bad
    line (by number) and why."""
    file = Path(path)
    if not file.is_file():
        raise FinetuneError(
            f"data file `{file}` does not exist; pass a JSONL file with one "
            '{"text": ...} or {"messages": [...]} object per line'
        )
    examples = []
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise FinetuneError(
                    f"`{file}` line {number}: not valid JSON ({err.msg} at column {err.colno}); "
                    "each line must be one JSON object"
                ) from None
            examples.append(_checked(record, file, number))
    if not examples:
        raise FinetuneError(f"`{file}` has no examples (every line is blank)")
    return examples


def _checked(record: Any, file: Path, number: int) -> dict[str, Any]:
    where = f"`{file}` line {number}"
    if not isinstance(record, dict):
        raise FinetuneError(f"{where}: a JSON {type(record).__name__}, not an object")
    keys = sorted(set(record) & {"text", "messages"})
    if len(keys) != 1:
        raise FinetuneError(
            f"{where}: has keys {sorted(record)}; an example needs exactly one of "
            '"text" (a string) or "messages" (a list of {"role", "content"} objects)'
        )
    if keys == ["text"]:
        if not isinstance(record["text"], str) or not record["text"]:
            raise FinetuneError(f'{where}: "text" must be a non-empty string')
        return record
    messages = record["messages"]
    ok = isinstance(messages, list) and messages
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )
    if not ok:
        raise FinetuneError(
            f'{where}: "messages" must be a non-empty list of objects with string '
            '"role" and "content"'
        )
    return record


def render(example: dict[str, Any], tokenizer: Any) -> str:
    """The example's text: `text` as is, `messages` through the tokenizer's chat template."""
    if "text" in example:
        return example["text"]
    if not getattr(tokenizer, "chat_template", None):
        raise FinetuneError(
            "the data has chat `messages` but the model directory's tokenizer has no chat "
            "template (chat_template.jinja or tokenizer_config.json's chat_template); use "
            '{"text": ...} lines or a model with a template'
        )
    return tokenizer.apply_chat_template(example["messages"], tokenize=False)


def to_rows(examples: list[dict[str, Any]], tokenizer: Any, seq_len: int) -> Rows:
    """Every example as one row of `seq_len` tokens (see the module docstring)."""
    import torch

    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    rows, tokens, truncated = [], 0, 0
    for example in examples:
        text = render(example, tokenizer)
        # a chat template writes its own special tokens; plain text gets the tokenizer's
        ids = tokenizer(text, add_special_tokens="text" in example)["input_ids"]
        if len(ids) > seq_len:
            ids, truncated = ids[:seq_len], truncated + 1
        n = len(ids)
        tokens += n
        input_ids = torch.full((seq_len,), pad, dtype=torch.long)
        input_ids[:n] = torch.tensor(ids, dtype=torch.long)
        mask = torch.zeros(seq_len, dtype=torch.long)
        mask[:n] = 1
        labels = torch.where(mask.bool(), input_ids, torch.full_like(input_ids, IGNORE))
        rows.append({"input_ids": input_ids, "attention_mask": mask, "labels": labels})
    return Rows(rows, tokens, truncated)
