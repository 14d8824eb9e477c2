"""The model's tokenizer and chat template, from its Hugging Face directory.

`tokenizers` (the Rust library transformers' fast tokenizers wrap) reads
`tokenizer.json`; the chat template (`chat_template.jinja`, else
`tokenizer_config.json["chat_template"]`) is rendered with jinja2 in a sandbox,
as transformers does. This avoids importing transformers (seconds of start-up and
a large dependency) for what is one JSON file and one template; encodings are
identical because transformers' fast tokenizer is this same object.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """encode/decode and the chat template of one model directory."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in `{model_dir}`; zserve needs a Hugging Face fast "
                "tokenizer (save one with `AutoTokenizer.from_pretrained(...).save_pretrained`)"
            )
        self._tok = HFTokenizer.from_file(str(path))
        tcfg = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_str(tcfg.get("bos_token"))
        self.eos_token = _token_str(tcfg.get("eos_token"))
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            self.chat_template: str | None = jinja.read_text(encoding="utf-8")
        else:
            tpl = tcfg.get("chat_template")
            if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
                tpl = next((t["template"] for t in tpl if t.get("name") == "default"), None)
            self.chat_template = tpl
        # EOS ids: generation_config.json (what `generate` stops on), config.json, and the
        # tokenizer's eos token, merged.
        eos: list[int] = []
        for cfg in (
            _read_json(model_dir / "generation_config.json"),
            _read_json(model_dir / "config.json"),
        ):
            v = cfg.get("eos_token_id")
            eos += [v] if isinstance(v, int) else list(v or [])
        if self.eos_token is not None and (i := self._tok.token_to_id(self.eos_token)) is not None:
            eos.append(i)
        self.eos_token_ids: list[int] = sorted(set(eos))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer's
        post-processor adds (a Llama tokenizer's BOS), as for a plain completion prompt."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        Raises ValueError when the model has no chat template, or when its template
        cannot render these messages (it calls ``raise_exception``, say "roles must
        alternate", or fails in jinja2); the message says which and why.
        """
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (no chat_template.jinja and no "
                "`chat_template` in tokenizer_config.json); use a plain completion prompt "
                "(`/v1/completions`)"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] is {m!r}; it needs `role` and `content`")
        from jinja2 import TemplateError

        try:
            if self._template is None:
                self._template = self._compile(self.chat_template)
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ValueError:
            raise  # raise_exception(...) in the template: its own message
        except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as exc:
            # jinja2's errors, and what template logic raises on messages it cannot use
            raise ValueError(
                f"the model's chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc

    def chat_token_ids(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the chat prompt for `messages`, as transformers'
        ``apply_chat_template(..., tokenize=True)`` gives them: the template writes any
        BOS itself, so encoding it adds no special tokens (else a Llama-family prompt
        would start with two BOS). Raises ValueError as `apply_chat_template`."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )

    @staticmethod
    def _compile(template: str) -> Any:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        return env.from_string(template)
