"""Two-number addition: a task whose answers a program checks.

Prompt: ``What is 23 + 58? Reply with the number only.``; reference answer ``81``.
Preference rule: the correct sum is preferred over a wrong one, ``sum + d`` with ``d`` drawn
from ±1..±9 (never 0, never below 0), so the two answers always differ in the last digit
and a model must add to tell them apart. :func:`check_sum` is the program that grades an
answer (used by held-out checks and as a verifiable reward).
"""

from __future__ import annotations

import random
import re

from zchat.data.types import PreferencePair, Prompt, SFTExample

RULE = (
    "arithmetic: the correct sum a+b is preferred over a+b+d, d drawn from ±1..±9 "
    "(the answers differ in their last digit)"
)
_NUMBER = re.compile(r"-?\d+")


def question(a: int, b: int) -> list[dict]:
    """The chat messages asking for ``a + b``."""
    return [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}]


def check_sum(answer: str, a: int, b: int) -> bool:
    """Whether the first number in ``answer`` is ``a + b`` (what a grader accepts)."""
    found = _NUMBER.search(answer)
    return found is not None and int(found.group()) == a + b


def wrong_sum(a: int, b: int, rng: random.Random) -> int:
    """``a + b + d`` with ``d`` in ±1..±9, kept non-negative."""
    total = a + b
    while True:
        d = rng.choice([-1, 1]) * rng.randint(1, 9)
        if total + d >= 0:
            return total + d


def operand_pairs(count: int, rng: random.Random, low: int, high: int) -> list[tuple[int, int]]:
    """``count`` distinct (a, b) pairs with both in [low, high], in random order."""
    space = (high - low + 1) ** 2
    if count > space:
        raise ValueError(
            f"asked for {count} distinct sums but [{low}, {high}] has only {space} pairs; "
            "widen the operand range or ask for fewer examples"
        )
    seen: set[tuple[int, int]] = set()
    while len(seen) < count:
        seen.add((rng.randint(low, high), rng.randint(low, high)))
    pairs = sorted(seen)
    rng.shuffle(pairs)
    return pairs


def arithmetic_examples(
    pairs: list[tuple[int, int]], rng: random.Random
) -> tuple[list[SFTExample], list[PreferencePair], list[Prompt]]:
    """(SFT examples, preference pairs, prompts) over the same operand pairs."""
    sft, prefs, prompts = [], [], []
    for a, b in pairs:
        messages = question(a, b)
        sft.append(SFTExample(messages, str(a + b)))
        prefs.append(PreferencePair(messages, str(a + b), str(wrong_sum(a, b, rng))))
        prompts.append(Prompt(messages, str(a + b)))
    return sft, prefs, prompts


def operands_of(messages: list[dict]) -> tuple[int, int]:
    """(a, b) back from a prompt :func:`question` wrote (for grading)."""
    numbers = [int(n) for n in _NUMBER.findall(messages[-1]["content"])]
    if len(numbers) < 2:
        raise ValueError(f"not an arithmetic prompt: {messages[-1]['content']!r}")
    return numbers[0], numbers[1]
