"""Sampling parameters and the sampler that turns a forward's logits into tokens.

Greedy when `temperature < MIN_TEMPERATURE` (0 included) or `top_k == 1`; otherwise
temperature, then top-k, then top-p (nucleus) filtering, then one multinomial draw. (A
smaller temperature is greedy in all but name, and logits divided by it overflow fp32 to
inf, whose softmax is NaN.) A constrained request (`SamplingParams.structured`) has its
row masked to the tokens its grammar allows first, so greedy picks the likeliest allowed
token and sampling draws among allowed tokens only. A request with a `seed` draws from its own `torch.Generator`,
so its output does not depend on which other requests share its batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from zserve.config import SEED_MAX, SEED_MIN
from zserve.logprobs import TokenLogprob as TokenLogprob
from zserve.logprobs import gather_logprobs as gather_logprobs
from zserve.structured.spec import GrammarSpec

MAX_LOGPROBS = 20
"""Most alternatives per token a request may ask for."""

MIN_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (vLLM's threshold too): logits / 1e-45 overflow."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops. Validated at construction;
    errors are `ValueError`s that name the field, the value and the allowed range."""

    max_tokens: int = 16
    """Most tokens to generate (>= 1; 0 scores the prompt only, with `prompt_logprobs`)."""
    temperature: float = 1.0
    """Softmax temperature; 0 (or anything below `MIN_TEMPERATURE`) means greedy."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 (or -1) keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; in (0, 1]."""
    seed: int | None = None
    """Seed of this request's own generator (reproducible sampling), a signed 64-bit
    integer, or None."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the returned text stops before them."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (besides the model's EOS unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens (benchmarks with fixed lengths)."""
    logprobs: int | None = None
    """Return each generated token's log-probability and this many likeliest alternatives
    (0: the token's only). Log-softmax of the model's raw logits, before temperature,
    top-k and top-p (vLLM's default `raw_logprobs`); None: none."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first (scoring, OpenAI's `echo`). The
    prompt is computed in full: no prefix-cache hits for such a request."""
    structured: GrammarSpec | None = None
    """A grammar the output must follow (`zserve.structured`): the engine masks every
    token the grammar does not allow before sampling, and ends the request with "stop"
    once the value is complete. None: free text."""

    def __post_init__(self) -> None:
        # Accept lists (JSON) for the tuple fields; frozen, hence object.__setattr__.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(
            isinstance(self.max_tokens, int)
            and (
                self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None)
            ),
            "max_tokens",
            self.max_tokens,
            "an integer >= 1 (0 only with prompt_logprobs)",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                name,
                value,
                f"None or an integer in [0, {MAX_LOGPROBS}]",
            )
        _check(
            isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 100,
            "temperature",
            self.temperature,
            "a number in [0, 100]",
        )
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            self.top_k,
            "an integer >= 1, or 0 / -1 for no limit",
        )
        _check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
            "top_p",
            self.top_p,
            "a number in (0, 1]",
        )
        _check(
            self.seed is None
            or (
                isinstance(self.seed, int)
                and not isinstance(self.seed, bool)
                and SEED_MIN <= self.seed <= SEED_MAX
            ),
            "seed",
            self.seed,
            f"an integer in [{SEED_MIN}, {SEED_MAX}] (64-bit) or None",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings"
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "non-negative integers",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"sampling parameter `{name}` is {value!r}; it must be {allowed}")


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`logits` (V,) with everything outside the top-k / top-p set at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


@dataclass
class Sampler:
    """Draws one token per row of a logits batch; `seed` seeds the shared generator
    used by requests without a seed of their own."""

    seed: int = 0
    _shared: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self._shared = torch.Generator().manual_seed(self.seed)

    def generator_for(self, params: SamplingParams) -> torch.Generator | None:
        """A fresh generator for a seeded request (kept by the request), else None."""
        return None if params.seed is None else torch.Generator().manual_seed(params.seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        masks: Sequence[torch.Tensor | None] | None = None,
    ) -> list[int]:
        """logits: (n, V) fp32, one row per request; returns n token ids. ``masks[i]``, a
        (V,) bool tensor or None, keeps row i's tokens where it is True (the caller's
        logits are not changed: it reads their log-probabilities afterwards)."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(params)} requests")
        logits = logits.float().cpu()
        if masks is not None and any(m is not None for m in masks):
            logits = _apply_masks(logits, masks)
        out = logits.argmax(dim=-1).tolist()  # greedy rows are done here, in one op
        for i, p in enumerate(params):
            if p.greedy:
                continue
            probs = _distribution(logits[i], p)
            out[i] = int(torch.multinomial(probs, 1, generator=self.generator(generators[i])))
        return out

    def distributions(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The distributions a sampled request draws from, one per row of ``logits`` (n, V):
        temperature, then top-k, then top-p, then softmax (fp32, on the CPU)."""
        return torch.stack([_distribution(r, params) for r in logits.float().cpu()])

    def generator(self, own: torch.Generator | None) -> torch.Generator:
        """A request's own generator, or the shared one for a request without a seed."""
        return own if own is not None else self._shared


def _distribution(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One fp32 CPU logits row ``(V,)`` to the distribution request ``p`` samples from."""
    return torch.softmax(_filter_top_k_top_p(row / p.temperature, p.top_k, p.top_p), dim=-1)


def _apply_masks(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """A copy of ``logits`` (n, V) with each masked row's disallowed tokens at -inf."""
    if len(masks) != logits.shape[0]:
        raise ValueError(f"{len(masks)} masks for {logits.shape[0]} logits rows")
    logits = logits.clone()
    for i, mask in enumerate(masks):
        if mask is None:
            continue
        if mask.shape != logits[i].shape:
            raise ValueError(
                f"mask {i} has shape {tuple(mask.shape)}; logits rows are {tuple(logits[i].shape)}"
            )
        if not bool(mask.any()):
            raise ValueError(f"mask {i} allows no token; a grammar that ended must end its request")
        logits[i].masked_fill_(~mask.to(logits.device), float("-inf"))
    return logits
