"""The reward model: a causal LM's backbone with a scalar head, scored at the last real token.

As in DeepSpeed-Chat's ``RewardModel``: the transformer without its LM head
(``AutoModel``'s class for the checkpoint's config) and ``v_head``, a bias-free
``hidden -> 1`` projection. ``values`` is the head applied at every position (``[B, T]``;
what PPO's critic, which starts from this model, reads); ``forward`` is the value at each
row's scored token (``[B]``; batches are right-padded, :mod:`zchat.data.render`):

- ``score_at="last"`` (DeepSpeed-Chat's ``chosen_end_scores``): the last non-pad token, which
  for a finished answer is the template's end-of-turn token;
- ``score_at="before_eos"``: the token before it when that last token is ``eos_id`` (the last
  token of the answer itself), else the last token. A causal LM's state at the end-of-turn
  token is about what follows the turn, not whether the answer was right
  (the probes: ``benchmarks/results/zchat-reward.md``).
Trained with the pairwise loss ``-logsigmoid(r_chosen - r_rejected)``
(:func:`pairwise_loss`).

On disk a reward model is a Hugging Face directory of the backbone (``config.json``,
``model.safetensors``, the tokenizer files; written by ``zcore.hf.save_pretrained`` from
ZeRO-3 partitions), plus ``value_head.safetensors`` (``v_head.weight``, ``[1, hidden]``) and
``zchat_reward.json`` (format, backbone class, hidden size, the tokenizer's fingerprint, the
model it was trained from, its held-out accuracy). :func:`check_same_tokenizer` refuses a
reward model whose tokenizer is not the actor's: its scores would read other token ids.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

META_FILE = "zchat_reward.json"
HEAD_FILE = "value_head.safetensors"
FORMAT = 1


class RewardModelError(ValueError):
    """A directory that is not a reward model, or one that does not fit the actor."""


class ValueHead(nn.Module):
    """``hidden -> 1`` without bias; the weight is passed in so that ``zcore.zero.Init``
    partitions it holding its value (``[1, hidden]``, as ``nn.Linear`` stores it)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone().reshape(1, -1))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.weight.t()).squeeze(-1)  # [B, T, H] -> [B, T]


SCORE_AT = ("last", "before_eos")
"""Where :meth:`RewardModel.forward` reads a row's score (see the module doc)."""


class RewardModel(nn.Module):
    """A backbone (``LlamaModel``, ...) and a scalar head: ``forward(ids, mask) -> [B]``."""

    def __init__(
        self,
        backbone: nn.Module,
        head_weight: torch.Tensor,
        *,
        score_at: str = "last",
        eos_id: int | None = None,
    ) -> None:
        super().__init__()
        if score_at not in SCORE_AT:
            raise ValueError(f"`score_at` must be one of {', '.join(SCORE_AT)}, got {score_at!r}")
        if score_at == "before_eos" and eos_id is None:
            raise ValueError("`score_at` before_eos needs the tokenizer's `eos_id`")
        self.backbone = backbone
        self.v_head = ValueHead(head_weight)
        self.score_at, self.eos_id = score_at, eos_id

    @property
    def config(self) -> Any:
        """The backbone's transformers config."""
        return self.backbone.config

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The head at every position, ``[B, T]``."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask)
        return self.v_head(out.last_hidden_state)

    def score_index(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The position of each right-padded row's scored token, ``[B]``."""
        last = attention_mask.long().sum(1).clamp(min=1) - 1  # [B]
        if self.score_at == "before_eos":
            ends = input_ids.gather(1, last[:, None]).squeeze(1) == self.eos_id
            last = last - (ends & (last > 0)).long()
        return last

    def scored_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The backbone's final hidden state at each row's scored token, ``[B, H]`` (what the
        head reads; a head-only warm-up fits the head on these)."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask)
        at = self.score_index(input_ids, attention_mask)
        return out.last_hidden_state[torch.arange(len(at)), at]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The score of each right-padded row: its value at the scored token, ``[B]``."""
        values = self.values(input_ids, attention_mask)
        at = self.score_index(input_ids, attention_mask)
        return values.gather(1, at[:, None]).squeeze(1)


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """``mean(-logsigmoid(r_chosen - r_rejected))`` over pairs (InstructGPT's ranking loss)."""
    return -F.logsigmoid(chosen - rejected).mean()


def head_init(hidden: int, seed: int) -> torch.Tensor:
    """``nn.Linear``'s default init for a ``hidden -> 1`` head, ``U(±1/sqrt(hidden))``, seeded."""
    g = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(hidden)
    return (torch.rand(1, hidden, generator=g) * 2 - 1) * bound


def _plain_config() -> dict[str, Any]:
    """A stage-0 config: the model is loaded whole (no process group needed)."""
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}


def _backbone(path: Path, ds_config: Any, dtype: torch.dtype) -> nn.Module:
    from transformers import MODEL_MAPPING, AutoConfig

    import zcore.hf

    config = AutoConfig.from_pretrained(str(path))
    cls = MODEL_MAPPING[type(config)]
    # strict=False: an LM checkpoint's `lm_head.weight` names nothing in the backbone
    return zcore.hf.from_pretrained(
        cls, path, config=config, dtype=dtype, strict=False, ds_config=ds_config
    )


def build_reward_model(
    lm_dir: str | os.PathLike[str],
    *,
    ds_config: Any = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    head: torch.Tensor | None = None,
    score_at: str = "last",
    eos_id: int | None = None,
) -> RewardModel:
    """A new reward model from a causal LM directory (the SFT output): its backbone and a
    fresh head (``head``, ``[1, hidden]``, when given: a warmed-up one). Under a stage-3
    ``ds_config`` (or an open ``zcore.zero.Init``) it is built partitioned; collective then.
    ``ds_config=None``: loaded whole."""
    from zcore.zero import Init

    cfg = ds_config if ds_config is not None else _plain_config()
    with contextlib.nullcontext() if Init.active() is not None else Init(config=cfg):
        backbone = _backbone(Path(lm_dir), cfg, dtype)
        weight = head if head is not None else head_init(backbone.config.hidden_size, seed)
        return RewardModel(backbone, weight.to(dtype), score_at=score_at, eos_id=eos_id)


def reward_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``zchat_reward.json`` of a reward model directory (an error naming the fix if absent)."""
    meta = Path(path) / META_FILE
    if not meta.is_file():
        raise RewardModelError(
            f"`{path}` is not a zchat reward model (no {META_FILE}); train one with "
            "`z chat reward --model SFT_DIR --out DIR`"
        )
    return json.loads(meta.read_text())


def load_reward_model(
    path: str | os.PathLike[str], *, ds_config: Any = None, dtype: torch.dtype = torch.float32
) -> RewardModel:
    """The reward model saved in ``path`` by :func:`save_reward_model`. Partitioned under a
    stage-3 ``ds_config`` or an open ``zcore.zero.Init`` (collective then); whole otherwise."""
    from safetensors.torch import load_file

    from zcore.zero import Init

    meta = reward_meta(path)
    if meta.get("format") != FORMAT:
        raise RewardModelError(f"`{path}`: {META_FILE} format {meta.get('format')} != {FORMAT}")
    head = load_file(str(Path(path) / HEAD_FILE))["v_head.weight"].to(dtype)
    cfg = ds_config if ds_config is not None else _plain_config()
    with contextlib.nullcontext() if Init.active() is not None else Init(config=cfg):
        return RewardModel(
            _backbone(Path(path), cfg, dtype),
            head,
            score_at=meta.get("score_at", "last"),
            eos_id=meta.get("eos_id"),
        )


def save_reward_model(
    model_or_engine: Any,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Any,
    source: str | os.PathLike[str],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``out_dir``: the backbone as a Hugging Face directory (tokenizer files copied from
    ``source``), ``value_head.safetensors`` and ``zchat_reward.json``. Collective (every rank
    calls it; rank 0 writes), at any ZeRO stage."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    import zcore.hf
    from zchat.data.render import tokenizer_fingerprint
    from zcore.zero.init import GatheredParameters

    model: RewardModel = getattr(model_or_engine, "module", model_or_engine)
    out = zcore.hf.save_pretrained(model.backbone, out_dir, tokenizer_from=source)
    rank = dist.get_rank() if dist.is_initialized() else 0
    weight = model.v_head.weight
    with GatheredParameters([weight]):
        if rank == 0:
            head = weight.detach().float().reshape(1, -1).clone()
            save_file({"v_head.weight": head}, str(out / HEAD_FILE), metadata={"format": "pt"})
            meta = {
                "format": FORMAT,
                "backbone": type(model.backbone).__name__,
                "hidden_size": int(head.shape[1]),
                "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                "trained_from": str(source),
                "score_at": model.score_at,
                "eos_id": model.eos_id,
                **(extra or {}),
            }
            (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier()
    return out


def check_same_tokenizer(
    reward_dir: str | os.PathLike[str], actor_tokenizer: Any, actor_dir: str | os.PathLike[str]
) -> None:
    """Raise :class:`RewardModelError` naming both directories when the reward model was
    trained with another tokenizer than the actor's (its scores would read other ids)."""
    from zchat.data.render import tokenizer_fingerprint

    theirs = reward_meta(reward_dir).get("tokenizer_fingerprint")
    ours = tokenizer_fingerprint(actor_tokenizer)
    if theirs != ours:
        raise RewardModelError(
            f"the reward model `{reward_dir}` was trained with another tokenizer (fingerprint "
            f"{theirs}) than the actor `{actor_dir}` uses ({ours}); train the reward model "
            "from the actor's SFT model (`z chat reward --model SFT_DIR`)"
        )
