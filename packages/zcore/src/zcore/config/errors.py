"""The one error a config can raise, and the pieces its message is built from.

Every problem found while loading a config becomes a :class:`ConfigProblem`
(key path, offending value, one line of text that says what would be valid);
:class:`ConfigError` carries all of them, one per line, so a config with three
mistakes is fixed in one round trip rather than three.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: Added to type errors for the value ``"auto"``, which DeepSpeed configs written for the
#: Hugging Face Trainer carry in place of numbers.
AUTO_HINT = (
    '; "auto" is filled in by the Hugging Face Trainer before DeepSpeed sees the config, '
    "so write the value here"
)


class _Missing:
    """Marks a problem that has no value to show (a required key that is absent)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def format_value(value: Any, limit: int = 80) -> str:
    """A value as it would be written in the JSON config, shortened to ``limit`` characters."""
    try:
        text = json.dumps(value, sort_keys=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the closest of ``choices``, or ``""`` when none is close."""
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in choices}
        close = [lowered[w] for w in difflib.get_close_matches(word.lower(), lowered, n=1)]
    return f"; did you mean {close[0]}?" if close else ""


def join_path(prefix: str, key: str | int) -> str:
    """``zero_optimization`` + ``stage`` -> ``zero_optimization.stage``; list indices as ``[i]``."""
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else key


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config."""

    path: str
    """Dotted key path, e.g. ``zero_optimization.reduce_bucket_size`` (``""`` for the whole config)."""
    message: str
    """The complete line shown to the user: names the path, the value and the fix."""
    value: Any = MISSING
    """The offending value as given, or :data:`MISSING`."""

    @classmethod
    def at(cls, path: str, value: Any, why: str) -> ConfigProblem:
        """The usual shape: ``<path> = <value>: <why>`` (``<path>: <why>`` without a value)."""
        where = path or "config"
        if value is MISSING:
            return cls(path, f"{where}: {why}", value)
        return cls(path, f"{where} = {format_value(value)}: {why}", value)

    def __str__(self) -> str:
        return self.message


class ConfigError(ValueError):
    """A config that zstack cannot run; the message lists every problem, one per line.

    ``problems`` holds them as :class:`ConfigProblem` for programs; ``source``
    names where the config came from (a file path) when it came from a file.
    """

    def __init__(self, problems: Sequence[ConfigProblem], source: str | None = None) -> None:
        if not problems:
            raise ValueError("ConfigError needs at least one problem")
        self.problems: tuple[ConfigProblem, ...] = tuple(problems)
        self.source = source
        super().__init__(self._render())

    @classmethod
    def single(cls, path: str, value: Any, why: str, source: str | None = None) -> ConfigError:
        """A ConfigError with one problem, ``<path> = <value>: <why>``."""
        return cls([ConfigProblem.at(path, value, why)], source)

    def _render(self) -> str:
        if len(self.problems) == 1:
            line = self.problems[0].message
            return f"{self.source}: {line}" if self.source else line
        where = self.source or "the config"
        lines = [f"{len(self.problems)} problems in {where}:"]
        lines += [f"  {p.message}" for p in self.problems]
        return "\n".join(lines)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.problems, self.source))


class ValueProblem(ValueError):
    """Raised by validators; the converter reports it as ``<model path>[.<key>] = <value>: <why>``.

    Pydantic locates an error raised by a model validator at the model itself;
    ``key`` names the sub-key (and ``value`` its value) so the message can name the
    exact key, e.g. ``zero_optimization.offload_param.device``.
    """

    def __init__(self, why: str, key: str | None = None, value: Any = MISSING) -> None:
        super().__init__(why)
        self.why = why
        self.key = key
        self.value = value


def problem_at(key: str, value: Any, why: str) -> ValueProblem:
    """A :class:`ValueProblem` at sub-key ``key`` of the model being validated."""
    return ValueProblem(why, key, value)
