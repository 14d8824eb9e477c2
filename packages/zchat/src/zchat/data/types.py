"""The hand-off objects between zchat's data and its stages: prompts, SFT examples,
preference pairs, and the six splits one builder makes.

Messages are chat messages as transformers' ``apply_chat_template`` takes them
(``{"role": "user", "content": "..."}``); answers are the assistant's text only, so any chat
model renders them with its own template (:mod:`zchat.data.render`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Prompt:
    """A prompt to answer (SFT held-out checks, PPO/GRPO rollouts)."""

    messages: list[dict]
    reference: str | None = None
    """The answer a program or the source text accepts (the sum, the play's real next line);
    None where there is none."""


@dataclass(frozen=True)
class SFTExample:
    """A prompt and the answer supervised fine-tuning teaches."""

    messages: list[dict]
    answer: str


@dataclass(frozen=True)
class PreferencePair:
    """One prompt, the answer preferred by the task's rule (``chosen``) and one it ranks
    below (``rejected``)."""

    messages: list[dict]
    chosen: str
    rejected: str


@dataclass(frozen=True)
class ChatData:
    """Every split of one task, built by :func:`zchat.data.build_chat_data` from one seed.

    ``*_train`` and ``*_heldout`` never share a prompt (arithmetic: no operand pair in
    both; Shakespeare: held-out examples come from the held-out plays only).
    """

    task: str
    rule: str
    """The preference rule, in words (reported with every reward/DPO metric)."""
    sft_train: list[SFTExample] = field(default_factory=list)
    sft_heldout: list[SFTExample] = field(default_factory=list)
    pairs_train: list[PreferencePair] = field(default_factory=list)
    pairs_heldout: list[PreferencePair] = field(default_factory=list)
    prompts_train: list[Prompt] = field(default_factory=list)
    prompts_heldout: list[Prompt] = field(default_factory=list)

    def sizes(self) -> dict[str, int]:
        """{split: number of examples}, for logs and checks."""
        return {
            name: len(getattr(self, name))
            for name in (
                "sft_train",
                "sft_heldout",
                "pairs_train",
                "pairs_heldout",
                "prompts_train",
                "prompts_heldout",
            )
        }


class EmptyDatasetError(ValueError):
    """A split a stage needs has no examples."""


def require_nonempty(items: list, split: str, fix: str) -> None:
    """Fail at start, naming the split and what to change, when ``items`` is empty."""
    if not items:
        raise EmptyDatasetError(f"the `{split}` split is empty; {fix}")
