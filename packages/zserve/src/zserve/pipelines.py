"""The non-persistent API, exported as `zserve.pipeline` (the function).

The module is named `pipelines` so that importing it never rebinds `zserve.pipeline`.

    pipe = zserve.pipeline(model_dir, policy="splitfuse")
    [c.text for c in pipe(["To be, or not to be", "Once more unto the breach"],
                          max_tokens=16, temperature=0)]

Loads the model once; each call adds the prompts to an engine and steps it until
they all finish.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

from zserve.engine import make_engine
from zserve.outputs import Completion
from zserve.sampling import SamplingParams

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Steps in a row that compute no token while requests are pending: a scheduler bug.
# (A chunked prefill step returns no output but computes its chunk: that is progress.)
_MAX_IDLE_STEPS = 1000


class Pipeline:
    """A loaded engine as a callable: prompts in, `Completion`s out (same order)."""

    def __init__(self, model_dir: str | Path, **config: Any) -> None:
        self.engine = make_engine(model_dir, **config)
        self._ids = itertools.count()

    def __call__(
        self, prompts: list[str] | str | list[list[int]], **sampling: Any
    ) -> list[Completion]:
        unknown = set(sampling) - _SAMPLING_FIELDS
        if unknown:
            raise TypeError(
                f"unknown sampling option(s) {sorted(unknown)}; valid: {sorted(_SAMPLING_FIELDS)}"
            )
        params = SamplingParams(**sampling)
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [f"pipe-{next(self._ids)}" for _ in prompts]
        done: dict[str, Completion] = {}
        try:
            for rid, prompt in zip(ids, prompts, strict=True):
                self.engine.add_request(rid, prompt, params)
                done[rid] = Completion(text="")
            idle = 0
            while self.engine.has_unfinished():
                computed = self.engine.num_forward_tokens
                outs = self.engine.step()
                progressed = outs or self.engine.num_forward_tokens != computed
                idle = 0 if progressed else idle + 1
                if idle > _MAX_IDLE_STEPS:
                    raise RuntimeError(
                        f"engine made no progress in {idle} steps: {self.engine.stats()}"
                    )
                for o in outs:
                    c = done[o.request_id]
                    c.text += o.text
                    c.token_ids += o.token_ids
                    c.prompt_tokens = o.prompt_tokens
                    if o.finished:
                        c.finish_reason, c.error = o.finish_reason, o.error
        finally:
            for rid in ids:  # an exception mid-way must not leave blocks held
                self.engine.abort(rid)
        return [done[rid] for rid in ids]

    def close(self) -> None:
        """Stop the engine's worker processes (tensor-parallel ranks); idempotent."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pipeline(model_dir: str | Path, **config: Any) -> Pipeline:
    """Load `model_dir` into an engine configured by `config` (`EngineConfig` fields)
    and return a callable `pipe(prompts, **sampling) -> list[Completion]`. With ``tp=N``
    this process is rank 0 of N tensor-parallel ranks (`pipe.close()` stops the others)."""
    return Pipeline(model_dir, **config)
