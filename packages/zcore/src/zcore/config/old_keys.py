"""Keys earlier DeepSpeed releases documented, read under their current name with a warning.

Configs in the wild still carry them. Each block model lists its own in its ``aliases``
class variable as ``{old key: OldKey(...)}``, and every entry names the DeepSpeed source
that documents the old key (none is added without one). Today:

- ``bfloat16`` -> ``bf16`` (``runtime/constants.py``, ``BFLOAT16_OLD``);
- ``zero_optimization.stage3_gather_fp16_weights_on_model_save`` -> the ``16bit`` name,
  ``zero_optimization.cpu_offload: true`` -> ``offload_optimizer: {"device": "cpu"}``,
  ``cpu_offload_param: true`` -> ``offload_param: {"device": "cpu"}`` (all three
  ``deprecated`` fields with a ``new_param`` in ``runtime/zero/config.py``);
- ``zero_optimization.cpu_offload_params`` (the same, as older releases spelled it in
  ``runtime/zero/constants.py``);
- ``zero_optimization.cpu_offload_use_pin_memory`` (deprecated with ``set_new_param``
  false: read and not applied, as DeepSpeed does);
- ``aio.thread_count`` -> ``intra_op_parallelism`` (``runtime/swap_tensor/constants.py``).

:meth:`ZConfig.load` warns with :class:`OldKeyWarning` (a ``FutureWarning``, which Python
shows by default) naming the key to write instead; a block model validated on its own
renames them silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zcore.config.errors import ValueProblem, format_value

#: What a conversion returns when the old key sets nothing (``cpu_offload: false``).
NOTHING: Any = type("Nothing", (), {"__repr__": lambda self: "NOTHING"})()


class OldKeyWarning(FutureWarning):
    """A config key DeepSpeed renamed was read under its current name; the message says
    which key to write. Silence with ``warnings.filterwarnings("ignore", category=...)``."""


@dataclass(frozen=True)
class OldKey:
    """One old DeepSpeed key of a block."""

    new: str
    """The key to write instead: a field of the same block, or a description of where the
    setting lives now when it has no single field (then nothing is renamed)."""
    source: str
    """Where DeepSpeed documents the old key."""
    convert: Callable[[Any], Any] | None = None
    """Old value -> the new key's value (:data:`NOTHING`: set nothing); raises
    :class:`ValueProblem` for a value the old key never took. None: the value as is."""
    note: str = ""
    """Added to the warning: how the value was read."""

    def value(self, old: Any) -> Any:
        """The value for :attr:`new`, or :data:`NOTHING`."""
        return old if self.convert is None else self.convert(old)

    def warning(self, old_path: str, new_path: str, old: Any, new: Any) -> str:
        """The line :meth:`ZConfig.load` warns with."""
        if new is NOTHING:
            return (
                f"`{old_path}` = {format_value(old)} is an old DeepSpeed key ({self.source}): "
                f"it sets nothing{self.note}; remove it (the setting is `{new_path}`)"
            )
        shown = "" if self.convert is None else f" = {format_value(new)}"
        return (
            f"`{old_path}` is an old DeepSpeed key ({self.source}): read as "
            f"`{new_path}`{shown}{self.note}; write that instead"
        )


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueProblem("must be true or false")
    return value


def offload_to_cpu(value: Any) -> Any:
    """``cpu_offload*: true`` -> an offload block on the CPU; ``false`` -> no block."""
    return {"device": "cpu"} if _flag(value) else NOTHING


def read_not_applied(value: Any) -> Any:
    """A flag DeepSpeed reads and no longer applies (its ``set_new_param: False``)."""
    _flag(value)
    return NOTHING
