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
        self._byte_decoder: dict[str, int] | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer's
        post-processor adds (a Llama tokenizer's BOS), as for a plain completion prompt."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, leading space included (what OpenAI's
        logprobs report: a token may hold part of a UTF-8 character). Byte-level BPE
        (GPT-2, SmolLM2, Llama 3) maps its characters back to bytes; SentencePiece
        (Llama 2, Mistral) writes a space as "▁" and raw bytes as "<0xNN>"."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_decoder is None:
            self._byte_decoder = _byte_level_decoder() if self._is_byte_level() else {}
        if self._byte_decoder and all(ch in self._byte_decoder for ch in piece):
            return bytes(self._byte_decoder[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def _is_byte_level(self) -> bool:
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
        return "ByteLevel" in kinds

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


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (the inverse of its
    `bytes_to_unicode`): printable bytes stand for themselves, the rest are shifted
    to U+0100 and up."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}
