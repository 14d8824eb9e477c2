"""Structured output: constrain a request's tokens to a grammar (JSON, a JSON schema, a
tool call), so what it generates is guaranteed to parse.

`GrammarSpec` (``spec.py``, no dependency) is what a request carries in
`SamplingParams.structured`; `GrammarBackend` (``backend.py``) compiles it for one
tokenizer with llguidance into a per-request `GrammarMatcher`, whose mask of allowed
tokens the sampler applies to the logits before it picks a token (greedy and sampled).
"""

from __future__ import annotations

from zserve.structured.spec import GrammarSpec, json_object, json_schema

__all__ = ["GrammarSpec", "json_object", "json_schema"]
