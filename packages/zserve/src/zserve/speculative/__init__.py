"""Speculative decoding: draft a few tokens cheaply, verify them in one target forward.

A decoding sequence with d drafted tokens puts 1 + d query tokens into the SplitFuse
forward (they count against `token_budget`); the target's logits at those positions
accept the longest prefix of the draft that greedy decoding would have produced, plus
the target's own next token. So greedy output is token-for-token what plain decoding
gives, in fewer target forwards when drafts are good.

* :mod:`~zserve.speculative.ngram` — prompt lookup: the tokens that followed the
  previous occurrence of the sequence's last n-gram (no model at all).
* :mod:`~zserve.speculative.self_draft` — the first L layers of the target itself, its
  final norm and head: no extra weights, and no KV memory of its own (see there).
* :mod:`~zserve.speculative.decoder` — the engine's side: how many drafts a sequence
  may get, proposing them, greedy acceptance, the counters.

Requests that sample (temperature > 0) are speculated too, with speculative sampling's
acceptance (decoder.py): each emitted token has plain sampling's distribution. A request
with a seed decodes plainly, so its output stays independent of the batch.
"""

from zserve.speculative.decoder import (
    SpecStats,
    SpeculativeDecoder,
    accept_greedy,
    accept_sampled,
)
from zserve.speculative.drafter import Drafter, DraftRequest
from zserve.speculative.factory import make_drafter
from zserve.speculative.ngram import NgramDrafter, ngram_propose
from zserve.speculative.self_draft import SelfDrafter

__all__ = [
    "DraftRequest",
    "Drafter",
    "NgramDrafter",
    "SelfDrafter",
    "SpecStats",
    "SpeculativeDecoder",
    "accept_greedy",
    "accept_sampled",
    "make_drafter",
    "ngram_propose",
]
