"""OpenAI request fields zserve does not implement, and their no-op values.

A request that sets one of these to anything but its no-op value is refused with a
400 naming the field: an answer that silently ignored ``logit_bias`` or a penalty
would look right and be wrong (``response_format`` and ``tools`` are served: see
`zserve.structured` and `tools.py`). The no-op values are what clients
send when the feature is off (LangChain sends ``presence_penalty: 0``, the ``openai``
package sends nothing), so those requests still work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v == x and type(v) is type(x) for x in values)


def _empty(v: Any) -> bool:
    return isinstance(v, (list, dict, str)) and not v


def _zero(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0


# field -> (is its value a no-op?, what to do instead)
_COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "presence_penalty": (_zero, "penalties are not implemented; send 0 or leave it out"),
    "frequency_penalty": (_zero, "penalties are not implemented; send 0 or leave it out"),
    "logit_bias": (_empty, "logit_bias is not implemented; leave it out"),
    "store": (_is(False), "zserve stores no completions; send false or leave it out"),
    "metadata": (_empty, "metadata is only kept by stored completions; leave it out"),
    "service_tier": (_is("auto", "default"), "zserve has one tier; send 'auto' or leave it out"),
}

_CHAT: dict[str, tuple[Callable[[Any], bool], str]] = {
    **_COMMON,
    "functions": (_empty, "function calling is not implemented; leave functions out"),
    "function_call": (_is("none"), "function calling is not implemented; leave it out"),
    "modalities": (lambda v: v == ["text"], "zserve answers in text only; send ['text']"),
    "audio": (lambda v: False, "zserve has no audio output; leave audio out"),
    "prediction": (lambda v: False, "predicted outputs are not implemented; leave it out"),
    "reasoning_effort": (lambda v: False, "not a reasoning model's server; leave it out"),
    "web_search_options": (lambda v: False, "zserve has no web search; leave it out"),
}

_COMPLETION: dict[str, tuple[Callable[[Any], bool], str]] = {
    **_COMMON,
    "best_of": (_is(1), "best_of is not implemented; send 1 or leave it out (n > 1 works)"),
    "suffix": (_empty, "suffix (insertion) is not implemented; leave it out"),
}

UNSUPPORTED: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "CompletionRequest": _COMPLETION,
    "ChatCompletionRequest": _CHAT,
}


def check_unsupported(data: Any, request_kind: str) -> Any:
    """``data`` without the unsupported fields that hold their no-op value; ValueError
    (message starting with the field's name) for the first one that does not.
    null is every field's no-op value."""
    table = UNSUPPORTED.get(request_kind, {})
    if not isinstance(data, dict) or not table:
        return data
    kept = dict(data)
    for key, value in data.items():
        if key not in table:
            continue
        is_noop, advice = table[key]
        if value is None or is_noop(value):
            del kept[key]
            continue
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ValueError(f"{key}: not supported by zserve (got {shown}); {advice}")
    return kept
