"""The engine: requests in, one scheduler step + one ragged forward per `step()`.

    engine = Engine(model_dir, policy="splitfuse", token_budget=256)
    engine.add_request("r1", "To be, or not to be", SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        for out in engine.step(): ...

Not thread-safe: one thread drives it (the HTTP server runs it in its own thread).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zserve.block_manager import BlockManager
from zserve.config import EngineConfig
from zserve.cpu_idle import IdlePolling
from zserve.detokenizer import IncrementalDetokenizer
from zserve.engine_setup import Runner, make_scheduler, merge_config, served_max_model_len
from zserve.logprobs import (
    TokenLogprob,
    gather_logprobs,
    record_prompt_logprobs,
    scores_prompt,
    token_logprobs,
)
from zserve.outputs import RequestOutput
from zserve.sampling import Sampler, SamplingParams
from zserve.scheduler import Sequence
from zserve.speculative import Drafter, SpeculativeDecoder, make_drafter

if TYPE_CHECKING:
    from zserve.structured.backend import GrammarBackend

log = logging.getLogger(__name__)


class Engine:
    """Continuous-batching engine over a `ModelRunner` and a scheduling policy."""

    supports_structured = True
    """It honours `SamplingParams.structured` (the static baseline does not)."""

    def __init__(
        self, model_dir: str | Path, config: EngineConfig | None = None, **overrides: Any
    ) -> None:
        from zserve.runner import ModelRunner
        from zserve.tokenizer import Tokenizer

        config = merge_config(config, overrides)
        if config.policy == "static":
            raise ValueError(
                "policy 'static' is transformers `generate`, not this engine; use "
                "`zserve.engine.make_engine` or `zserve.pipeline(..., policy='static')`"
            )
        options: dict[str, Any] = dict(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            dtype=config.torch_dtype,
            device=config.device,
            kv_cache_bytes=config.kv_cache_bytes,
            max_model_len=config.max_model_len,
            offload=config.offload_spec(),
        )
        runner: Runner
        if config.tp > 1:  # this process is rank 0 of `tp` (zserve.tp)
            from zserve.tp.runner import TPRunner

            runner = TPRunner(
                model_dir,
                config.tp,
                timeout_s=config.tp_timeout_s,
                collectives=config.tp_collectives,
                **options,
            )
        else:
            runner = ModelRunner(model_dir, **options)
        try:
            self._setup(runner, Tokenizer(model_dir), config, Path(model_dir).name)
        except BaseException:
            close = getattr(runner, "close", None)  # a tensor-parallel runner's ranks
            if close is not None:
                close()
            raise
        self.tokenizer_json: Path | None = Path(model_dir) / "tokenizer.json"

    @classmethod
    def from_parts(
        cls,
        runner: Runner,
        tokenizer: Any,
        config: EngineConfig,
        model_name: str = "model",
        drafter: Drafter | None = None,
    ) -> Engine:
        """An engine over a given runner and tokenizer (tests use model-free fakes);
        `drafter` replaces the one `config.speculative` names."""
        self = cls.__new__(cls)
        self._setup(runner, tokenizer, config, model_name, drafter)
        return self

    def _setup(
        self,
        runner: Runner,
        tokenizer: Any,
        config: EngineConfig,
        name: str,
        drafter: Drafter | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self._idle = IdlePolling.for_engine(config.cpu_idle, config.tp)
        self._step_threads: Callable[[int, int], AbstractContextManager[None]] | None = getattr(
            getattr(runner, "model", None), "step_threads", None
        )
        self.tokenizer = tokenizer
        self.model_name = name
        self.max_model_len = served_max_model_len(runner)
        if self.max_model_len < runner.max_model_len:
            log.warning(
                "zserve: max_model_len capped at %d tokens (was %d): the KV cache holds only "
                "%d blocks x %d tokens; give it more (num_blocks / kv_cache_bytes) to serve "
                "longer requests",
                self.max_model_len,
                runner.max_model_len,
                runner.num_blocks,
                runner.block_size,
            )
        self.eos_token_ids = set(getattr(tokenizer, "eos_token_ids", []) or []) | set(
            getattr(runner, "eos_token_ids", []) or []
        )
        self.kv = BlockManager(runner.num_blocks, runner.block_size, config.prefix_caching)
        if drafter is None and config.speculative is not None:
            drafter = make_drafter(config, runner)
        if drafter is not None and config.policy != "splitfuse":
            raise ValueError(
                f"speculative decoding needs policy 'splitfuse'; got {config.policy!r}"
            )
        self.spec = (
            None if drafter is None else SpeculativeDecoder(drafter, config.num_speculative_tokens)
        )
        self.scheduler = make_scheduler(
            config, self.kv, self.max_model_len, None if self.spec is None else self.spec.lookahead
        )
        self.sampler = Sampler(config.seed)
        self._ids = itertools.count()
        self._live: dict[str, Sequence] = {}
        self.num_steps = 0
        self.num_forward_tokens = 0
        # structured output: the tokenizer file llguidance reads, and the backend built
        # from it on the first constrained request (`from_parts` engines have none)
        self.tokenizer_json = None
        self._grammars: GrammarBackend | None = None

    # -- requests -----------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request. ValueError (naming the field) for a duplicate id, an empty
        prompt, or a prompt that leaves no room for `max_tokens` in `max_model_len`
        (which the KV cache's size caps, see `served_max_model_len`)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params is a {type(params).__name__}; pass a SamplingParams")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id is {request_id!r}; it must be a non-empty string")
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already running; use a new id")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            vocab = getattr(self.tokenizer, "vocab_size", None)
            bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside [0, {vocab})")
        else:
            raise TypeError(f"prompt is a {type(prompt).__name__}; pass a str or a list of ints")
        if not ids:
            raise ValueError("prompt is empty (0 tokens); send at least one token")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(ids) + params.max_tokens} exceeds max_model_len "
                f"{self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        matcher = (
            None
            if params.structured is None
            else self._grammar_backend().matcher(params.structured)
        )
        seq = Sequence(next(self._ids), request_id, ids, params)
        seq.extra["gen"] = self.sampler.generator_for(params)
        if matcher is not None:
            seq.extra["grammar"] = matcher
        seq.extra["detok"] = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        self._live[request_id] = seq
        self.scheduler.add(seq)

    def _grammar_backend(self) -> GrammarBackend:
        if self._grammars is None:
            if self.tokenizer_json is None or not Path(self.tokenizer_json).is_file():
                raise ValueError(
                    "structured output (response_format / tool calls) needs the model's "
                    f"tokenizer.json; this engine has none ({self.tokenizer_json})"
                )
            from zserve.structured.backend import GrammarBackend

            self._grammars = GrammarBackend(self.tokenizer_json, self.eos_token_ids)
        return self._grammars

    def abort(self, request_id: str) -> None:
        """Drop a request and free its KV blocks now; unknown ids are a no-op."""
        seq = self._live.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.abort(request_id)
            self._release_idle()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def polls_idle_cores(self) -> bool:
        """Idle cores poll while requests are in flight (`cpu_idle`, :mod:`zserve.cpu_idle`)."""
        return self._idle is not None

    # -- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step and one ragged forward; the outputs of every request that
        produced a token or finished in it."""
        from zserve.runner import SeqChunk

        sched = self.scheduler.schedule()
        results = [self._final(seq, "error") for seq in sched.finished]
        self.num_steps += 1
        if not sched.chunks:
            self._release_idle()
            return results
        # Speculative decoding: a decode with reserved slots carries its draft too, and
        # gets the logits of every token (row i checks draft i).
        drafts = self.spec.propose(sched.chunks, self.kv) if self.spec else [[]] * len(sched.chunks)
        # a constrained request is not drafted: a draft token is checked against the
        # model, not against the grammar
        drafts = [
            [] if "grammar" in c.seq.extra else d for c, d in zip(sched.chunks, drafts, strict=True)
        ]
        chunks: list[SeqChunk] = []
        spans: list[tuple[int, int]] = []  # each chunk's (first logits row, rows)
        rows = 0
        for c, draft in zip(sched.chunks, drafts, strict=True):
            scores = scores_prompt(c.seq, c.start) or bool(draft)
            n = c.num_tokens + len(draft) if scores else int(c.want_logits)
            table = self.kv.block_table(c.seq.seq_id)
            chunks.append(
                SeqChunk(c.seq.seq_id, c.token_ids + draft, c.start, table, c.want_logits, scores)
            )
            spans.append((rows, n))
            rows += n
        tokens = sched.num_tokens + sum(map(len, drafts))
        # The model's threads for this forward (a CPU model on znative's kernels), if any.
        threads = self._step_threads(tokens, rows) if self._step_threads else nullcontext()
        if self._idle is not None:
            self._idle.hold()  # until nothing is unfinished (zserve.cpu_idle)
        with threads:
            results += self._run(sched, chunks, spans, drafts)
        self.num_forward_tokens += tokens
        self._release_idle()
        return results

    def _release_idle(self) -> None:
        """Idle cores halt again once nothing is unfinished (:mod:`zserve.cpu_idle`)."""
        if self._idle is not None and not self.has_unfinished():
            self._idle.release()

    def _run(
        self, sched: Any, chunks: list[Any], spans: list[tuple[int, int]], drafts: list[list[int]]
    ) -> list[RequestOutput]:
        """The forward of one scheduled step and everything after it: sampling,
        verification of drafts, the step's outputs."""
        results: list[RequestOutput] = []
        if self._greedy_only(sched, chunks):  # each rank finds its rows' argmax
            tokens = self.runner.forward_greedy(chunks)
            self.scheduler.update(sched)
            sampled = [c.seq for c in sched.chunks if c.want_logits]
            return [self._append(seq, tok) for seq, tok in zip(sampled, tokens, strict=True)]
        logits = self.runner.forward(chunks)
        self.scheduler.update(sched)
        last_rows = []
        verified: list[tuple[Sequence, list[int], torch.Tensor]] = []
        for c, chunk, (first, n), draft in zip(sched.chunks, chunks, spans, drafts, strict=True):
            if draft:
                verified.append((c.seq, draft, logits[first : first + n]))
                continue
            if chunk.all_logits:
                record_prompt_logprobs(c.seq, c.start, logits[first : first + n])
            if c.want_logits:
                last_rows.append(first + n - 1)
        sampled = [
            c.seq for c, d in zip(sched.chunks, drafts, strict=True) if c.want_logits and not d
        ]
        if len(last_rows) != logits.shape[0]:
            logits = logits[torch.tensor(last_rows, dtype=torch.int64, device=logits.device)]
        masks = None
        if any("grammar" in s.extra for s in sampled):
            width = logits.shape[-1]
            masks = [
                s.extra["grammar"].allowed(width) if "grammar" in s.extra else None for s in sampled
            ]
        tokens = self.sampler.sample(
            logits, [s.params for s in sampled], [s.extra["gen"] for s in sampled], masks
        )
        lps = token_logprobs(logits, sampled, tokens)
        for seq, tok, lp in zip(sampled, tokens, lps, strict=True):
            results.append(self._append(seq, tok, lp))
        accepted = {seq.seq_id: self._verify(seq, d, r, results) for seq, d, r in verified}
        for c in sched.chunks:
            if c.num_lookahead and not c.seq.finished:
                self.scheduler.commit_lookahead(c.seq, accepted.get(c.seq.seq_id, 0))
        return results

    def _greedy_only(self, sched: Any, chunks: list[Any]) -> bool:
        """Whether this step needs no more than each sampled row's argmax, and the runner finds
        it without gathering the logits (``Runner.greedy_skips_logits``): no drafts, no
        scored prompt, every sampled request greedy without logprobs or grammar."""
        if self.spec is not None or not self.runner.greedy_skips_logits:
            return False
        if any(ch.all_logits for ch in chunks):
            return False
        return all(
            c.seq.params.greedy and c.seq.params.logprobs is None and "grammar" not in c.seq.extra
            for c in sched.chunks
            if c.want_logits
        )

    def _verify(
        self, seq: Sequence, draft: list[int], rows: torch.Tensor, results: list[RequestOutput]
    ) -> int:
        """Accept what the target agrees with of `seq`'s draft (`rows`: the target's
        logits at the pending token and each draft), append the emitted tokens (stop
        conditions checked token by token, as plain decoding would), return the number
        of accepted drafts."""
        assert self.spec is not None
        if seq.params.greedy:
            toks = self.spec.verify(draft, rows)
        else:
            probs = self.sampler.distributions(rows, seq.params)
            toks = self.spec.verify(draft, rows, probs, self.sampler.generator(seq.extra["gen"]))
        lps: list[TokenLogprob | None] = [None] * len(toks)
        if seq.params.logprobs is not None:
            n = len(toks)
            lps = list(gather_logprobs(rows[:n], toks, [seq.params.logprobs] * n))
        results.append(self._append_tokens(seq, toks, lps))
        return len(toks) - 1

    def _append(self, seq: Sequence, tok: int, lp: TokenLogprob | None = None) -> RequestOutput:
        return self._append_tokens(seq, [tok], [lp])

    def _append_tokens(
        self, seq: Sequence, toks: list[int], lps: list[TokenLogprob | None]
    ) -> RequestOutput:
        """Append `toks` one by one until one ends the request; one output for them."""
        p = seq.params
        prompt_lp = None
        if p.prompt_logprobs is not None and "prompt_lp_sent" not in seq.extra:
            # sampling means the whole prompt ran: its every position is recorded
            prompt_lp = seq.extra.pop("prompt_lp", None) or [None] * len(seq.prompt_token_ids)
            seq.extra["prompt_lp_sent"] = True
        if p.max_tokens == 0:  # scoring only: the prompt's logprobs, no token
            self.scheduler.finish(seq, "length")
            out = self._final(seq, "length")
            out.logprobs = [] if p.logprobs is not None else None
            out.prompt_logprobs = prompt_lp
            return out
        detok: IncrementalDetokenizer = seq.extra["detok"]
        grammar = seq.extra.get("grammar")
        reason = None
        for tok, lp in zip(toks, lps, strict=True):
            seq.output_token_ids.append(tok)
            if lp is not None:
                seq.extra.setdefault("lps", []).append(lp)
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                reason = "stop"  # the stop token is in token_ids, not in the text
            else:
                detok.add(tok)
                if grammar is not None:
                    grammar.consume(tok)
                if grammar is not None and grammar.done:
                    reason = "stop"  # the value is complete: nothing may follow it
                elif detok.stopped:
                    reason = "stop"
                elif len(seq.output_token_ids) >= p.max_tokens:
                    reason = "length"
            if reason is not None:
                break
        first = seq.extra.get("sent", 0)
        seq.extra["sent"] = len(seq.output_token_ids)
        out = RequestOutput(
            request_id=seq.request_id,
            token_ids=seq.output_token_ids[first:],
            text=detok.delta(final=reason is not None),
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=len(seq.prompt_token_ids),
            completion_tokens=len(seq.output_token_ids),
            logprobs=seq.extra["lps"][first:] if p.logprobs is not None else None,
            prompt_logprobs=prompt_lp,
        )
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._live.pop(seq.request_id, None)
        return out

    def _final(self, seq: Sequence, reason: str) -> RequestOutput:
        self._live.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=[],
            text="",
            finished=True,
            finish_reason=seq.finish_reason or reason,
            prompt_tokens=len(seq.prompt_token_ids),
            completion_tokens=len(seq.output_token_ids),
            error=seq.error,
        )

    def close(self) -> None:
        """Stop what the runner started (a tensor-parallel runner's worker ranks)."""
        if self._idle is not None:
            self._idle.release()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def stats(self) -> dict[str, int | float]:
        """Allocator, queue and prefix-cache counters (for /metrics and tests)."""
        s: dict[str, int | float] = dict(self.scheduler.stats())
        s["num_steps"] = self.num_steps
        s["num_forward_tokens"] = self.num_forward_tokens
        if self.spec is not None:
            s.update(self.spec.stats.as_dict())
        return s


def make_engine(model_dir: str | Path, config: EngineConfig | None = None, **overrides: Any):
    """An `Engine`, or the `StaticBatchEngine` baseline when `policy="static"`."""
    config = merge_config(config, overrides)
    if config.policy == "static":
        from zserve.model.quantized import is_zquant_dir
        from zserve.static_batch import StaticBatchEngine

        if is_zquant_dir(model_dir):
            raise ValueError(
                f"policy 'static' runs transformers on plain checkpoints; `{model_dir}` is a "
                "zquant directory (`z quantize`): serve it with policy 'splitfuse' or "
                "'prefill-first'"
            )
        return StaticBatchEngine(model_dir, config)
    return Engine(model_dir, config)
