"""DeepSpeed features zstack does not build yet, and the registry that unlocks them.

A DeepSpeed config may name features that live (or will live) in other zstack
packages: offload (zoffload), quantized collectives (zcomm), compression
(zquant), mixture of experts (zmoe), or that nobody builds. zcore cannot run
them, so a config that turns one on fails at load with a message naming the
key and the package that will own it, instead of training without it.

A package that does build a feature unlocks its key at import time::

    from zcore.config import register_feature
    register_feature("zero_optimization.offload_optimizer")

Unlocked keys that are not zcore fields (e.g. ``compression_training``) are kept as given and
handed over through :meth:`ZConfig.extension`. :func:`register_feature` also
accepts new keys zcore has never heard of, for a package's own config block.
This module is the only place that decides whether a gated key may be used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zcore.config.errors import ConfigProblem, format_value, join_path


def _disabled_block(value: Any) -> bool:
    """A block DeepSpeed reads as off: ``null`` or a block with ``"enabled": false``.

    Keys beside ``"enabled": false`` are settings of a feature that is off, so
    they are accepted unread (generated configs often carry them).
    """
    return value is None or (isinstance(value, dict) and value.get("enabled") is False)


def _absent(value: Any) -> bool:
    """A block with no on-switch is accepted only as ``null``."""
    return value is None


def _offload_off(value: Any) -> bool:
    """An offload block that offloads nothing: its device is not ``"cpu"`` or ``"nvme"``
    (``"none"``, or a value the block's own validation rejects)."""
    return not isinstance(value, dict) or value.get("device") not in ("cpu", "nvme")


def _equals(default: Any) -> Callable[[Any], bool]:
    def inert(value: Any) -> bool:
        return value is None or (type(value) is type(default) and value == default)

    return inert


@dataclass(frozen=True)
class Feature:
    """A config key zcore accepts only while it leaves the feature off."""

    key: str
    """Full dotted key path, e.g. ``zero_optimization.zero_quantized_weights``."""
    owner: str | None
    """The zstack package that will build it, or None when none is planned."""
    inert: Callable[[Any], bool]
    """True for values that leave the feature off; those load without registering."""
    hint: str = "remove it from the config"
    """What the user can do instead."""

    def problem(self, value: Any) -> ConfigProblem:
        if self.key.endswith((".offload_optimizer", ".offload_param")):
            device = value.get("device") if isinstance(value, dict) else value
            return ConfigProblem.at(
                join_path(self.key, "device"),
                device,
                f"offload is provided by the {self.owner} package, which is not installed: "
                f'`pip install {self.owner}`, or set device to "none" or remove the block',
            )
        owner = (
            f"it will come with the {self.owner} package"
            if self.owner
            else "no zstack package plans it"
        )
        return ConfigProblem(
            self.key,
            f"`{self.key}` is a DeepSpeed feature zstack does not build yet ({owner}); "
            f"{self.hint} (got {format_value(value)})",
            value,
        )


_OFF_SWITCH = 'remove it from the config or set "enabled": false'
_GATED: tuple[Feature, ...] = (
    Feature("zero_optimization.offload_optimizer", "zoffload", _offload_off),
    Feature("zero_optimization.offload_param", "zoffload", _offload_off),
    Feature("aio", "zoffload", _absent),
    Feature("zero_optimization.zero_quantized_weights", "zcomm", _equals(False)),
    Feature("zero_optimization.zero_quantized_gradients", "zcomm", _equals(False)),
    Feature(
        "zero_optimization.zero_hpz_partition_size",
        "zcomm",
        _equals(1),
        "remove it from the config or set it to 1",
    ),
    Feature("zero_optimization.round_robin_gradients", None, _equals(False)),
    Feature("compression_training", "zquant", _absent),
    Feature("moe", "zmoe", _disabled_block, _OFF_SWITCH),
    Feature("activation_checkpointing", None, _absent),
    Feature("flops_profiler", None, _disabled_block, _OFF_SWITCH),
    Feature("wandb", None, _disabled_block, _OFF_SWITCH),
    Feature("comet", None, _disabled_block, _OFF_SWITCH),
    Feature("comms_logger", None, _disabled_block, _OFF_SWITCH),
    Feature("autotuning", None, _disabled_block, _OFF_SWITCH),
    Feature("elasticity", None, _disabled_block, _OFF_SWITCH),
    Feature("sparse_attention", None, _absent),
    Feature("amp", None, _disabled_block, _OFF_SWITCH),
    Feature("checkpoint", None, _absent),
)
#: Gated keys by full dotted path.
GATED: dict[str, Feature] = {f.key: f for f in _GATED}

_registered: set[str] = set()


def _canonical(key_path: str) -> str:
    # The offload error names `...offload_optimizer.device`; registering that path works too.
    if key_path.endswith(".device") and key_path.removesuffix(".device") in GATED:
        return key_path.removesuffix(".device")
    return key_path


def register_feature(key_path: str) -> None:
    """Unlock ``key_path`` (dotted, e.g. ``"aio"`` or ``"zero_optimization.offload_param"``).

    Called by the package that builds the feature, at import. A gated key then
    loads with any value; a key that is not a zcore field is kept as given and
    returned by :meth:`ZConfig.extension`. Registering twice is harmless.
    """
    if not isinstance(key_path, str) or not key_path or key_path.strip(".") != key_path:
        raise ValueError(f"register_feature: key path must be a dotted name, got {key_path!r}")
    _registered.add(_canonical(key_path))


def unregister_feature(key_path: str) -> None:
    """Lock ``key_path`` again (tests, mostly); unknown paths are ignored."""
    _registered.discard(_canonical(key_path))


def registered_features() -> frozenset[str]:
    """The key paths unlocked so far."""
    return frozenset(_registered)


def is_registered(key_path: str) -> bool:
    """Whether ``key_path`` has been unlocked by :func:`register_feature`."""
    return key_path in _registered


def gate(key_path: str, value: Any) -> ConfigProblem | None:
    """The problem with using ``value`` at ``key_path``, or None when it may be used.

    None when the key is not gated, has been registered, or its value leaves
    the feature off.
    """
    feature = GATED.get(key_path)
    if feature is None or key_path in _registered or feature.inert(value):
        return None
    load_extensions()  # an installed package that builds it registers on import
    if key_path in _registered:
        return None
    return feature.problem(value)


EXTENSIONS_GROUP = "zcore.extensions"
_loaded = False


def load_extensions() -> None:
    """Import every installed package that extends zcore (entry-point group
    ``zcore.extensions``, e.g. zoffload), once; importing one registers its features."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=EXTENSIONS_GROUP):
        ep.load()
