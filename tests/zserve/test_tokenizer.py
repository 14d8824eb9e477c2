"""`zserve.tokenizer.Tokenizer` against transformers' tokenizer of the same directory:
chat prompts tokenize as ``apply_chat_template(..., tokenize=True)`` does (one BOS on a
Llama-style tokenizer, whose template writes BOS and whose encoding adds it too), plain
encodes add special tokens only when asked, and a chat template that cannot render the
messages (or is missing) is a ValueError saying so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.utils.models import smollm2_dir
from tests.zserve.chat_models import BOS_ID, llama_style_dir
from zserve.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Who wrote Hamlet?"}],
    [
        {"role": "user", "content": "To be, or not to be?"},
        {"role": "assistant", "content": "That is the question."},
        {"role": "user", "content": "Who asks it? Café 🙂"},
    ],
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_style_dir(tmp_path_factory.mktemp("llama-style"))


def _hf(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _hf_chat_ids(hf: Any, messages: list[dict[str, str]]) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out if isinstance(out, list) else out["input_ids"])  # a BatchEncoding in v5


@pytest.mark.parametrize("which", ["smollm2", "llama-style"])
def test_chat_token_ids_equal_transformers(which: str, llama_dir: Path) -> None:
    model_dir = smollm2_dir() if which == "smollm2" else llama_dir
    tok, hf = Tokenizer(model_dir), _hf(model_dir)
    for messages in CONVERSATIONS:
        ids = tok.chat_token_ids(messages)
        assert ids == _hf_chat_ids(hf, messages), messages
        if which == "llama-style":  # the template's BOS, and no second one from encode
            assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1, ids[:4]


def test_encode_adds_special_tokens_only_when_asked(llama_dir: Path) -> None:
    tok, hf = Tokenizer(llama_dir), _hf(llama_dir)
    text = "To be, or not to be"
    with_bos = tok.encode(text)
    assert with_bos == hf(text).input_ids and with_bos[0] == BOS_ID
    bare = tok.encode(text, add_special_tokens=False)
    assert bare == hf(text, add_special_tokens=False).input_ids == with_bos[1:]
    # SmolLM2's own tokenizer adds nothing either way
    smol = Tokenizer(smollm2_dir())
    assert smol.encode(text) == smol.encode(text, add_special_tokens=False)


def test_template_failures_are_value_errors_that_say_why(llama_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer(llama_dir)
    system_first = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.chat_token_ids(system_first)
    assert tok.chat_token_ids(CONVERSATIONS[0])[0] == BOS_ID  # still usable afterwards

    bare = Tokenizer(llama_style_dir(tmp_path / "none", chat_template=None))
    assert bare.chat_template is None
    with pytest.raises(ValueError, match=r"no chat template .*/v1/completions"):
        bare.chat_token_ids(CONVERSATIONS[0])

    # jinja2's own errors (an undefined attribute's use, a filter that does not exist)
    for i, (template, words) in enumerate(
        [
            ("{{ messages[0].nope.deeper }}", "has no attribute 'nope'"),
            ("{{ messages | no_such_filter }}", "no_such_filter"),
            # template logic failing on the messages: a type error, not a jinja2 one
            ("{{ messages[0].content + 1 }}", "TypeError"),
        ]
    ):
        broken = Tokenizer(llama_style_dir(tmp_path / f"broken{i}", chat_template=template))
        with pytest.raises(
            ValueError, match=f"chat template failed on these messages: .*({words})"
        ):
            broken.chat_token_ids(CONVERSATIONS[0])
