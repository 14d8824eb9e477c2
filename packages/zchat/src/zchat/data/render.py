"""Chat examples to token ids with the model's own chat template, labels on answers only.

A conversation is rendered twice with ``tokenizer.apply_chat_template``: the prompt with the
generation prompt (``<|im_start|>assistant\\n`` for SmolLM2) and the prompt plus the
assistant's answer. The first must be a prefix of the second; the tokens after it (the
answer and the template's end-of-turn token, where a rendering ends: generation stops
there) are the only ones with labels, so SFT and the
log-probabilities DPO compares cover what the model writes, never the prompt.
Batches are right-padded: the last real token of row ``i`` is ``mask[i].sum() - 1``, which
is where a reward model reads its score.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

IGNORE = -100
"""Label of a token that carries no loss (torch's ``cross_entropy`` ``ignore_index``)."""


class ChatTemplateError(ValueError):
    """The model's tokenizer has no chat template, or one that rewrites earlier turns."""


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The model directory's tokenizer, checked to have a chat template, with a pad token
    (its end-of-sequence token when it names none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    check_chat_template(tokenizer, path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_chat_template(tokenizer: Any, source: str | os.PathLike[str]) -> None:
    """Raise :class:`ChatTemplateError` naming ``source`` when there is no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"the model `{source}` has no chat template (no `chat_template` in "
            "tokenizer_config.json, no chat_template.jinja); use an instruct/chat model such "
            "as SmolLM2-135M-Instruct (`make models`), or add a chat_template.jinja to the "
            "model directory"
        )


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The prompt's ids, ending with the template's generation prompt."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return _ids(tokenizer, text)


def render_answer(
    tokenizer: Any, messages: list[dict], answer: str, max_len: int | None = None
) -> tuple[list[int], list[int]]:
    """(ids, labels) of the prompt followed by ``answer`` as the assistant's turn; labels
    are ``IGNORE`` on the prompt. Cut to the last ``max_len`` tokens' worth of prompt
    (the answer is kept whole) when given."""
    prompt = render_prompt(tokenizer, messages)
    turn = [*messages, {"role": "assistant", "content": answer}]
    full = _ids(tokenizer, tokenizer.apply_chat_template(turn, tokenize=False))
    if full[: len(prompt)] != prompt:
        raise ChatTemplateError(
            "the chat template renders the prompt differently once the answer follows it, so "
            "answer tokens cannot be told apart; use a model whose template only appends "
            "the assistant turn (SmolLM2, LLaMA-3, Qwen2)"
        )
    eos = tokenizer.eos_token_id
    answer_part = full[len(prompt) :]
    if eos in answer_part:  # end at the end-of-turn token: what generation stops on
        full = full[: len(prompt) + len(answer_part) - answer_part[::-1].index(eos)]
    labels = [IGNORE] * len(prompt) + full[len(prompt) :]
    if max_len is not None and len(full) > max_len:
        cut = len(full) - max_len
        if cut > len(prompt):
            raise ValueError(
                f"an answer of {len(full) - len(prompt)} tokens does not fit `max_len` "
                f"{max_len}; raise `max_len`"
            )
        full, labels = full[cut:], labels[cut:]
    return full, labels


def pad_right(
    rows: list[list[int]], pad_id: int, fill: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids ``[B, T]``, mask ``[B, T]``) with each row right-padded with ``fill`` (default
    ``pad_id``) to the longest."""
    width = max(len(r) for r in rows)
    value = pad_id if fill is None else fill
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def answer_batch(
    tokenizer: Any, items: list[tuple[list[dict], str]], max_len: int | None = None
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``labels`` (``[B, T]``) for (messages, answer)
    items, right-padded."""
    rendered = [render_answer(tokenizer, m, a, max_len) for m, a in items]
    ids, mask = pad_right([r[0] for r in rendered], tokenizer.pad_token_id)
    labels, _ = pad_right([r[1] for r in rendered], tokenizer.pad_token_id, fill=IGNORE)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of what makes two tokenizers interchangeable: the vocabulary (token to
    id), the special tokens and the chat template."""
    h = hashlib.sha256()
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{index}\t{token}\n".encode())
    special = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    h.update(repr(special).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()[:16]


def model_has_weights(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a safetensors checkpoint (a quick check before any rank starts)."""
    folder = Path(path)
    return (folder / "model.safetensors").is_file() or (
        folder / "model.safetensors.index.json"
    ).is_file()


def pair_batch(
    tokenizer: Any, pairs: list[Any], max_len: int | None = None
) -> dict[str, torch.Tensor]:
    """:func:`answer_batch` of preference pairs: chosen answers (rows ``[0, B)``) then
    rejected ones (``[B, 2B)``), right-padded."""
    items = [(p.messages, p.chosen) for p in pairs] + [(p.messages, p.rejected) for p in pairs]
    return answer_batch(tokenizer, items, max_len)
