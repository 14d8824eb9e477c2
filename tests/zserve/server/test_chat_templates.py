"""Chat over HTTP with Llama-style tokenizers (SmolLM2's weights, see chat_models.py): the
prompt is exactly transformers' ``apply_chat_template(..., tokenize=True)`` (one BOS, not the
template's plus the encoder's), and a template that refuses the messages, or a model with
no template, is a 400 on `messages` (it was a plain-text 500)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.zserve.chat_models import BOS_ID, llama_style_dir
from tests.zserve.server.conftest import LiveServer, serving

USER_TURNS = [
    {"role": "user", "content": "Who wrote Hamlet?"},
    {"role": "assistant", "content": "Shakespeare."},
    {"role": "user", "content": "And Macbeth?"},
]
SYSTEM_FIRST = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
]


def _serve(model_dir: Path) -> Any:
    from zserve.engine import Engine

    return serving(Engine(model_dir, num_blocks=16, block_size=16))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_style_dir(tmp_path_factory.mktemp("llama-style"))


@pytest.fixture(scope="module")
def llama_server(llama_dir: Path) -> Iterator[LiveServer]:
    with _serve(llama_dir) as server:
        yield server


@pytest.fixture(scope="module")
def no_template_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with _serve(llama_style_dir(tmp_path_factory.mktemp("no-template"), None)) as server:
        yield server


def test_chat_prompt_is_transformers_apply_chat_template(
    llama_server: LiveServer, llama_dir: Path
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(llama_dir)
    want = hf.apply_chat_template(USER_TURNS, tokenize=True, add_generation_prompt=True)
    want = list(want if isinstance(want, list) else want["input_ids"])
    assert want[0] == BOS_ID and want.count(BOS_ID) == 1
    chat = {"model": llama_dir.name, "messages": USER_TURNS, "max_tokens": 4, "temperature": 0}
    resp = httpx.post(f"{llama_server.url}/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert got["usage"]["prompt_tokens"] == len(want)
    # the same ids sent as a completion prompt give the same greedy answer
    plain = {"model": llama_dir.name, "prompt": want, "max_tokens": 4, "temperature": 0}
    resp = httpx.post(f"{llama_server.url}/v1/completions", json=plain, timeout=60)
    assert resp.json()["choices"][0]["text"] == got["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_template_that_refuses_the_messages_is_400(
    llama_server: LiveServer, llama_dir: Path, stream: bool
) -> None:
    body = {"model": llama_dir.name, "messages": SYSTEM_FIRST, "max_tokens": 2, "stream": stream}
    resp = httpx.post(f"{llama_server.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "messages" and err["type"] == "invalid_request_error", err
    assert err["message"].startswith("messages: ") and "roles must alternate" in err["message"]
    # and the server goes on serving
    ok = {**body, "messages": USER_TURNS[:1], "stream": False}
    assert httpx.post(f"{llama_server.url}/v1/chat/completions", json=ok, timeout=60).is_success


def test_model_without_a_chat_template_is_400(no_template_server: LiveServer) -> None:
    name = no_template_server.engine.model_name
    body = {"model": name, "messages": USER_TURNS[:1], "max_tokens": 2}
    resp = httpx.post(f"{no_template_server.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "messages", err
    assert "no chat template" in err["message"] and "/v1/completions" in err["message"]
    plain = {"model": name, "prompt": "To be, or not", "max_tokens": 2, "temperature": 0}
    resp = httpx.post(f"{no_template_server.url}/v1/completions", json=plain, timeout=60)
    assert resp.status_code == 200, resp.text
