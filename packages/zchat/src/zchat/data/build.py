"""One deterministic builder for every split of a task (:func:`build_chat_data`)."""

from __future__ import annotations

import random

from zchat.data import arithmetic, shakespeare
from zchat.data.types import ChatData

TASKS = ("arithmetic", "shakespeare")
"""The tasks :func:`build_chat_data` builds."""


def build_chat_data(
    task: str = "arithmetic",
    *,
    train: int = 512,
    heldout: int = 128,
    seed: int = 0,
    train_plays: list[tuple[str, str]] | None = None,
    heldout_plays: list[tuple[str, str]] | None = None,
    low: int = 10,
    high: int = 99,
) -> ChatData:
    """``train`` and ``heldout`` examples of ``task`` in each of SFT, preference pairs and
    prompts; the same arguments give the same data on every rank and every run.

    Args:
        task: ``arithmetic`` (sums of two numbers in [low, high]; no operand pair is in
            both splits) or ``shakespeare`` (needs ``train_plays`` and ``heldout_plays``,
            e.g. zstack's ``split_plays(load_plays())``; held-out windows come from the
            held-out plays only).
        train, heldout: examples per split (≥ 0; a stage that needs an empty split refuses
            to start, naming it).
        seed: everything random (operands, wrong sums, windows, rejected lines).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task `{task}`; choose one of {', '.join(TASKS)}")
    if train < 0 or heldout < 0:
        raise ValueError(f"example counts must be ≥ 0, got train={train} heldout={heldout}")
    rng = random.Random(f"zchat-{task}-{seed}")
    if task == "arithmetic":
        pairs = arithmetic.operand_pairs(train + heldout, rng, low, high)
        tr = arithmetic.arithmetic_examples(pairs[:train], rng)
        ho = arithmetic.arithmetic_examples(pairs[train:], rng)
        rule = arithmetic.RULE
    else:
        if train_plays is None or heldout_plays is None:
            raise ValueError(
                "the shakespeare task needs `train_plays` and `heldout_plays` "
                "(zstack: `split_plays(load_plays())`)"
            )
        tr = shakespeare.shakespeare_examples(train_plays, train, rng)
        ho = shakespeare.shakespeare_examples(heldout_plays, heldout, rng)
        rule = shakespeare.RULE
    return ChatData(task, rule, tr[0], ho[0], tr[1], ho[1], tr[2], ho[2])
