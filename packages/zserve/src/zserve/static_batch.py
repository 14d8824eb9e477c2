"""The static-batch baseline: transformers `generate` on padded batches.

A batch is formed from the requests waiting when the previous batch ends (up to
`max_num_seqs`), left-padded to its longest prompt, and generated to its longest
`max_tokens`; nobody joins or leaves mid-batch. That is the serving model that
continuous batching replaced, kept as the benchmark's reference point.

Same interface as `Engine` (add_request / step / has_unfinished / abort / stats); a
`step()` runs a whole batch. `token_times[request_id]` holds the wall time at which
each of the request's tokens came out of `generate` (a streaming static server could
deliver them then), so the benchmark does not charge the baseline for batching its
outputs. Sampling options apply per batch (the first request's); greedy is exact.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from zserve.config import EngineConfig
from zserve.detokenizer import IncrementalDetokenizer
from zserve.outputs import RequestOutput
from zserve.sampling import SamplingParams
from zserve.tokenizer import Tokenizer


class StaticBatchEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig) -> None:
        from transformers import AutoModelForCausalLM, StoppingCriteria  # lazy: heavy

        self.config = config
        self.tokenizer = Tokenizer(model_dir)
        self.model_name = Path(model_dir).name
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=config.torch_dtype)
            .to(config.device)
            .eval()
        )
        limit = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.max_model_len = config.max_model_len or limit
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self._waiting: list[tuple[str, list[int], SamplingParams]] = []
        self.token_times: dict[str, list[float]] = {}
        self.num_steps = 0
        self.num_forward_tokens = 0  # padded prompt tokens plus generated ones, as computed

        times = self._step_times = []

        class _Clock(StoppingCriteria):
            """Records when each decoding step ends; never stops anything."""

            def __call__(self, input_ids, scores, **kwargs):
                times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        self._clock = _Clock()

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> None:
        params = SamplingParams() if params is None else params
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty (0 tokens); send at least one token")
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError(
                "logprobs: the static baseline (policy 'static') returns no logprobs; "
                "serve with policy 'splitfuse' or 'prefill-first'"
            )
        if params.structured is not None:
            raise ValueError(
                f"{params.structured.kind}: the static baseline (policy 'static') does not "
                "constrain decoding; serve with policy 'splitfuse' or 'prefill-first'"
            )
        if any(r == request_id for r, _, _ in self._waiting):
            raise ValueError(f"request_id {request_id!r} is already queued; use a new id")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        self._waiting.append((request_id, ids, params))

    def abort(self, request_id: str) -> None:
        self._waiting = [w for w in self._waiting if w[0] != request_id]

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def stats(self) -> dict[str, int | float]:
        return {
            "num_waiting": len(self._waiting),
            "num_running": 0,
            "num_steps": self.num_steps,
            "num_forward_tokens": self.num_forward_tokens,
        }

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Generate one whole batch; every output is final."""
        if not self._waiting:
            return []
        batch = self._waiting[: self.config.max_num_seqs]
        self._waiting = self._waiting[len(batch) :]
        self.num_steps += 1
        pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        width = max(len(ids) for _, ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (_, ids, _) in enumerate(batch):  # left padding: every prompt ends at `width`
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            mask[i, width - len(ids) :] = 1
        p0 = batch[0][2]
        new = max(p.max_tokens for _, _, p in batch)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=new, pad_token_id=pad, eos_token_id=self.eos_token_ids or None
        )
        if all(p.ignore_eos for _, _, p in batch):
            kwargs["min_new_tokens"] = new
        if p0.greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(
                do_sample=True, temperature=p0.temperature, top_k=p0.top_k or None, top_p=p0.top_p
            )
            if p0.seed is not None:
                torch.manual_seed(p0.seed)
        self._step_times.clear()
        dev = self.model.device
        gen = self.model.generate(
            input_ids=input_ids.to(dev),
            attention_mask=mask.to(dev),
            stopping_criteria=[self._clock],
            **kwargs,
        )
        out_ids = gen[:, width:].tolist()
        self.num_forward_tokens += gen.numel()
        results = []
        for (rid, ids, p), toks in zip(batch, out_ids, strict=True):
            kept: list[int] = []
            reason = "length"
            detok = IncrementalDetokenizer(self.tokenizer, ids, p.stop)
            for t in toks[: p.max_tokens]:
                kept.append(t)
                if t in p.stop_token_ids or (not p.ignore_eos and t in self.eos_token_ids):
                    reason = "stop"
                    break
                detok.add(t)
                if detok.stopped:
                    reason = "stop"
                    break
            self.token_times[rid] = self._step_times[: len(kept)]
            results.append(
                RequestOutput(rid, kept, detok.delta(final=True), True, reason, len(ids), len(kept))
            )
        return results
