"""ZeRO++'s four config keys, read with DeepSpeed's names and checked together at start.

DeepSpeed puts them in ``zero_optimization``::

    "zero_quantized_weights": true,        qwZ: INT8 block-quantized stage-3 weight gathers
    "zero_hpz_partition_size": 2,          hpZ: backward gathers inside groups of 2 ranks
    "zero_quantized_gradients": true,      qgZ: INT4 hierarchical all-to-all gradient reduction
    "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}    LoCo error feedback for qgZ

zcore gates the first three (:mod:`zcore.config.features`) until zcomm registers them; zcore
has no field for any of them, so they reach this module as written, through
:meth:`ZConfig.extension`. Every combination that cannot run is a :class:`ConfigError` at
engine start naming the key, its value and the fix: all four need ZeRO stage 3 (DeepSpeed
reads them only in its stage-3 partitioner), ``zeropp_loco_param`` needs qgZ and takes
exactly DeepSpeed's two keys, qgZ needs the reduce-scatter layout (``reduce_scatter``).
``zero_hpz_partition_size`` that does not divide the ZeRO axis is refused earlier, by the
mesh (:func:`zcore.comm.mesh.spec_from_config`), with the same kind of message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zcore.config import ConfigError, ConfigProblem

ZERO = "zero_optimization"
QWZ = f"{ZERO}.zero_quantized_weights"
QGZ = f"{ZERO}.zero_quantized_gradients"
HPZ = f"{ZERO}.zero_hpz_partition_size"
LOCO = f"{ZERO}.zeropp_loco_param"
KEYS = (QWZ, HPZ, QGZ, LOCO)
"""The config keys ZeRO++ reads (full dotted paths)."""

LOCO_DEFAULTS: dict[str, float | int] = {"err_beta": 0.8, "reset_T": 1024}
"""DeepSpeed's LoCo keys with the values its documentation and tests use. DeepSpeed reads
both unconditionally (a missing one is a ``KeyError`` mid-backward); here they default."""


@dataclass(frozen=True)
class LocoConfig:
    """``zeropp_loco_param``: LoCo's error feedback for qgZ's INT4 gradient all-to-alls."""

    err_beta: float = 0.8
    """How much of the old error each update keeps: ``e <- beta e + (1 - beta) (x + e - Q(x + e))``."""
    reset_T: int = 1024
    """A bucket's error buffers restart from zero after this many reductions of that bucket."""


@dataclass(frozen=True)
class ZeroPPConfig:
    """Which ZeRO++ parts a config turns on."""

    quantized_weights: bool = False
    """qwZ: stage-3 parameter gathers travel as INT8 codes + one fp32 scale per block."""
    hpz_partition_size: int = 1
    """hpZ: ranks per secondary partition (the mesh's ``dp_local``); 1 is off."""
    quantized_gradients: bool = False
    """qgZ: gradient buckets reduce-scatter as INT4 codes, intra-node then inter-node."""
    loco: LocoConfig | None = None
    """LoCo error feedback for qgZ, or None."""

    @property
    def enabled(self) -> bool:
        """Whether any ZeRO++ part is on (then zcomm's collectives claim the config)."""
        return self.quantized_weights or self.quantized_gradients or self.hpz_partition_size > 1

    @classmethod
    def from_config(cls, config: Any) -> ZeroPPConfig:
        """Read and check the keys of a :class:`~zcore.config.ZConfig` (or a config without
        them: everything off). Raises :class:`ConfigError` listing every problem."""
        ext = getattr(config, "extension", None)
        if ext is None:
            return cls()
        raw = {key: ext(key) for key in KEYS}
        problems: list[ConfigProblem] = []
        qwz = _flag(QWZ, raw[QWZ], problems)
        qgz = _flag(QGZ, raw[QGZ], problems)
        hpz = _hpz(raw[HPZ], problems)
        loco = _loco(raw[LOCO], problems)
        zc = config.zero_optimization
        stage = int(zc.stage)
        fix = f"set {ZERO}.stage to 3 or remove the key"
        for key, on in ((QWZ, qwz), (QGZ, qgz), (HPZ, hpz > 1), (LOCO, loco is not None)):
            if on and stage != 3:
                problems.append(
                    ConfigProblem.at(
                        key,
                        raw[key],
                        f"ZeRO++ partitions parameters, so it needs ZeRO stage 3 ({ZERO}.stage is "
                        f"{stage}); {fix}",
                    )
                )
        if loco is not None and not qgz:
            problems.append(
                ConfigProblem.at(
                    LOCO,
                    raw[LOCO],
                    f"LoCo is error feedback for qgZ's quantized gradients, which are off; set "
                    f"{QGZ} to true or remove {LOCO}",
                )
            )
        if qgz and stage == 3 and not zc.reduce_scatter:
            problems.append(
                ConfigProblem.at(
                    QGZ,
                    raw[QGZ],
                    f"qgZ replaces the gradient reduce-scatter, and {ZERO}.reduce_scatter is false "
                    "(buckets are all-reduced); set reduce_scatter to true or turn qgZ off",
                )
            )
        if problems:
            raise ConfigError(problems)
        return cls(qwz, hpz, qgz, loco)


def _flag(key: str, value: Any, problems: list[ConfigProblem]) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        problems.append(ConfigProblem.at(key, value, "must be true or false"))
        return False
    return value


def _hpz(value: Any, problems: list[ConfigProblem]) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(
            ConfigProblem.at(
                HPZ,
                value,
                "must be a positive whole number of ranks (1: off; e.g. the GPUs per node)",
            )
        )
        return 1
    return value


def _loco(value: Any, problems: list[ConfigProblem]) -> LocoConfig | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        problems.append(
            ConfigProblem.at(
                LOCO, value, 'must be an object such as {"err_beta": 0.8, "reset_T": 1024}'
            )
        )
        return None
    unknown = sorted(set(value) - set(LOCO_DEFAULTS))
    for key in unknown:
        problems.append(
            ConfigProblem.at(
                f"{LOCO}.{key}",
                value[key],
                "unknown LoCo key; DeepSpeed's are err_beta and reset_T",
            )
        )
    beta = value.get("err_beta", LOCO_DEFAULTS["err_beta"])
    reset = value.get("reset_T", LOCO_DEFAULTS["reset_T"])
    ok = not unknown
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0 <= beta < 1:
        problems.append(
            ConfigProblem.at(
                f"{LOCO}.err_beta", beta, "must be a number in [0, 1) (DeepSpeed uses 0.8)"
            )
        )
        ok = False
    if isinstance(reset, bool) or not isinstance(reset, int) or reset < 1:
        problems.append(
            ConfigProblem.at(
                f"{LOCO}.reset_T",
                reset,
                "must be a positive whole number of reductions (DeepSpeed uses 1024)",
            )
        )
        ok = False
    return LocoConfig(float(beta), int(reset)) if ok else None
