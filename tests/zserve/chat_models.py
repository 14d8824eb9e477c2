"""SmolLM2-135M-Instruct with another tokenizer set-up, for chat-template tests.

`llama_style_dir` writes a model directory whose weights, config and generation config are
SmolLM2's (symlinked, so an engine serves it exactly as SmolLM2) but whose tokenizer behaves
like a Llama/Mistral one: its post-processor puts BOS before every encoding, and its chat
template writes ``bos_token`` itself and refuses conversations whose roles do not alternate
user/assistant. With ``chat_template=None`` the directory has no chat template at all.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.utils.models import smollm2_dir

BOS = "<|endoftext|>"
"""The BOS token of the Llama-style directory (id 0 in SmolLM2's vocabulary)."""
BOS_ID = 0

# Mistral-7B-Instruct-v0.1's template (Llama-2's without the system-prompt branch)
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)


def llama_style_dir(out: Path, chat_template: str | None = LLAMA_TEMPLATE) -> Path:
    """SmolLM2 in ``out`` with a BOS-adding tokenizer and ``chat_template`` (None: none)."""
    from tokenizers import Tokenizer, processors

    src = smollm2_dir()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (out / name).symlink_to(src / name)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    # what a Llama tokenizer.json carries: BOS before the sequence (add_special_tokens=True)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["bos_token"] = BOS
    config.pop("chat_template", None)
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out
