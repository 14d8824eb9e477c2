"""What the engine hands back: per-step deltas (`RequestOutput`) and whole
completions (`Completion`, from `pipeline`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from zserve.logprobs import TokenLogprob


@dataclass
class RequestOutput:
    """One request's progress in one engine step (deltas, for streaming)."""

    request_id: str
    token_ids: list[int]
    """New tokens since this request's previous output."""
    text: str
    """New text since the previous output (stop strings excluded; text that may be the
    start of a stop string is held back until it is decided)."""
    finished: bool
    finish_reason: str | None
    """"stop" | "length" | "abort" | "error" | None while running."""
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    """One per entry of `token_ids`, when the request asked for `logprobs`."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt token (the first is None: nothing predicts it), in the request's
    first output, when it asked for `prompt_logprobs`."""


@dataclass
class Completion:
    """A finished request, as `pipeline` returns it."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    error: str | None = None
