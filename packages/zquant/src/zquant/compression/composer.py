"""The compression composer: DeepSpeed's `init_compression` / `compression_scheduler` /
`redundancy_clean`, over zquant's masks and quantizers.

`init_compression(model, config)` wires every enabled method onto the modules its groups
match (regexes over module names), *off*; `compression_scheduler(model, config)` returns the
object the training loop `.step()`s once per optimizer step, which switches each method on at
its `schedule_offset` and steps weight bits from `start_bits` down to `target_bits`, one bit
every `quantization_period` steps. Methods compose on one layer: pruning masks come first in
the weight's parametrization chain, then weight quantization; activation quantization is a
forward pre-hook on the layer input. `redundancy_clean(model, config)` finally removes what
structured pruning masked.

Weight bits follow DeepSpeed: 1 = binary, 2 = ternary, 3..16 = integers; `quantize_groups`
splits the flattened weight into that many groups with one scale each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from zquant.clean import redundancy_clean as _clean
from zquant.compression.config import (
    CompressionConfig,
    CompressionConfigError,
    load_compression_config,
)
from zquant.pruning import (
    PruneMask,
    original_weight,
    prune_channels,
    prune_heads,
    prune_rows,
    prune_sparse,
)
from zquant.quantizers import QuantSpec, fake_quantize, fake_quantize_activation
from zquant.xtc import find_layers, reduce_layers

_LINEAR = (nn.Linear,)
_CONV_OR_LINEAR = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class ScheduledWeightQuant(nn.Module):
    """Weight parametrization: fake-quantize at `bits` (DeepSpeed groups) once `enabled`."""

    def __init__(self, bits: int, groups: int, symmetric: bool) -> None:
        super().__init__()
        self.bits, self.groups, self.symmetric = bits, groups, symmetric
        self.enabled = False

    def spec(self) -> QuantSpec:
        if self.bits == 1:
            return QuantSpec(1, "binary", granularity="channel")
        if self.bits == 2 and self.symmetric:
            return QuantSpec(2, "ternary", granularity="channel")
        return QuantSpec(self.bits, "int", symmetric=self.symmetric, granularity="channel")

    def forward(self, weight: Tensor) -> Tensor:
        if not self.enabled:
            return weight
        if weight.numel() % self.groups:
            raise ValueError(
                f"quantize_groups {self.groups} does not divide a weight of {weight.numel()} "
                f"elements {tuple(weight.shape)}; pick a divisor"
            )
        # One row per DeepSpeed group, one scale per row.
        rows = weight.reshape(self.groups, -1)
        return fake_quantize(rows, self.spec()).view_as(weight)


class ActivationQuant:
    """Forward pre-hook: token-wise fake quantization of the layer input once `enabled`."""

    def __init__(self, bits: int, symmetric: bool) -> None:
        self.bits, self.symmetric, self.enabled = bits, symmetric, False

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not self.enabled:
            return None
        return (fake_quantize_activation(args[0], self.bits, self.symmetric), *args[1:])


@dataclass
class _Scheduled:
    technique: str
    offset: int
    items: list[tuple[str, Any]] = field(default_factory=list)  # (module name, mask/quant)
    start_bits: int = 0
    target_bits: int = 0
    period: int = 1


@dataclass
class CompressionState:
    """What `init_compression` wired, read by the scheduler and `redundancy_clean`."""

    config: CompressionConfig
    scheduled: list[_Scheduled] = field(default_factory=list)


def _match(model: nn.Module, patterns: list[str], kinds: tuple[type, ...], where: str) -> list[str]:
    names = [n for n, m in model.named_modules() if isinstance(m, kinds)]
    found: list[str] = []
    for pattern in patterns:
        if pattern == "*":
            hits = names
        else:
            try:
                regex = re.compile(pattern)
            except re.error as exc:
                raise CompressionConfigError(f"{where}.modules: {pattern!r}: {exc}") from exc
            hits = [n for n in names if regex.search(n)]
        if not hits:
            kinds_text = "/".join(k.__name__ for k in kinds)
            raise CompressionConfigError(
                f"{where}.modules: {pattern!r} matches no {kinds_text} module of "
                f"{type(model).__name__}; e.g. {names[:3]}"
            )
        found += [n for n in hits if n not in found]
    return found


def _groups(technique: Any, name: str) -> list[tuple[str, Any]]:
    return [(f"{name}.different_groups.{g}", grp) for g, grp in technique.different_groups.items()]


def _related(group: Any, index: int) -> list[str]:
    if not group.related_modules:
        return []
    return list(group.related_modules[min(index, len(group.related_modules) - 1)])


def init_compression(
    model: nn.Module, config: Any, teacher_model: nn.Module | None = None
) -> nn.Module:
    """Wire the config's enabled methods onto `model` (all off until their offset); returns it.

    With `layer_reduction` the returned model is a new, reduced copy of `teacher_model` (or of
    `model`), so use the return value.
    """
    cfg = load_compression_config(config)
    lr = cfg.layer_reduction
    if lr.enabled:
        source = teacher_model if teacher_model is not None else model
        names = {n for n, _ in source.named_modules()}
        missing = [n for n in lr.other_module_name if n not in names]
        if missing:
            raise CompressionConfigError(
                f"compression_training.layer_reduction.other_module_name: {missing} are not "
                f"modules of {type(source).__name__}"
            )
        prefix = lr.module_name_prefix or find_layers(source)[0]
        model = reduce_layers(source, lr.teacher_layer, prefix=prefix)
    state = CompressionState(cfg)

    for tname, technique, fn, kinds in (
        ("sparse_pruning", cfg.sparse_pruning, prune_sparse, _LINEAR),
        ("row_pruning", cfg.row_pruning, prune_rows, _LINEAR),
        ("head_pruning", cfg.head_pruning, None, _LINEAR),
        ("channel_pruning", cfg.channel_pruning, prune_channels, _CONV_OR_LINEAR),
    ):
        shared = technique.shared_parameters
        if not shared.enabled:
            continue
        sched = _Scheduled(tname, shared.schedule_offset)
        for where, group in _groups(technique, f"compression_training.{tname}"):
            for i, pattern in enumerate(group.modules):
                for name in _match(model, [pattern], kinds, where):
                    module = model.get_submodule(name)
                    ratio = group.params.dense_ratio
                    if fn is None:
                        mask = prune_heads(
                            module, shared.num_heads, ratio, shared.method, enable=False
                        )
                    else:
                        mask = fn(module, ratio, shared.method, enable=False)
                    mask.related = _related(group, i)
                    sched.items.append((name, mask))
        state.scheduled.append(sched)

    wq = cfg.weight_quantization
    if wq.shared_parameters.enabled:
        shared = wq.shared_parameters
        for where, group in _groups(wq, "compression_training.weight_quantization"):
            p = group.params
            sched = _Scheduled(
                "weight_quantization",
                shared.schedule_offset,
                start_bits=p.start_bits,
                target_bits=p.target_bits,
                period=max(p.quantization_period, 1),
            )
            for name in _match(model, group.modules, _LINEAR, where):
                quant = ScheduledWeightQuant(
                    p.start_bits, shared.quantize_groups, shared.quantization_type == "symmetric"
                )
                parametrize.register_parametrization(
                    model.get_submodule(name), "weight", quant, unsafe=True
                )
                sched.items.append((name, quant))
            state.scheduled.append(sched)

    aq = cfg.activation_quantization
    if aq.shared_parameters.enabled:
        shared = aq.shared_parameters
        sched = _Scheduled("activation_quantization", shared.schedule_offset)
        for where, group in _groups(aq, "compression_training.activation_quantization"):
            for name in _match(model, group.modules, _LINEAR, where):
                hook = ActivationQuant(group.params.bits, shared.quantization_type == "symmetric")
                model.get_submodule(name).register_forward_pre_hook(hook)
                sched.items.append((name, hook))
        state.scheduled.append(sched)

    model._zquant_compression = state  # type: ignore[assignment]
    return model


def _state(model: nn.Module) -> CompressionState:
    state = getattr(model, "_zquant_compression", None)
    if not isinstance(state, CompressionState):
        raise ValueError(
            f"{type(model).__name__} has no compression wired; call "
            "`model = init_compression(model, config)` first"
        )
    return state


class CompressionScheduler:
    """Switches methods on by training step; call `.step()` once per optimizer step.

    After `k` calls (`training_steps == k`) every method with `schedule_offset <= k` is on;
    weight bits are `max(target, start - (k - offset) // quantization_period)`.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.state = _state(model)
        self.training_steps = 0
        self._apply()

    def step(self, step_zero_check: bool = False) -> None:
        """Advance one training step (DeepSpeed's signature; the flag is accepted and unused)."""
        self.training_steps += 1
        self._apply()

    def _apply(self) -> None:
        step = self.training_steps
        for sched in self.state.scheduled:
            if step < sched.offset:
                continue
            for name, item in sched.items:
                if isinstance(item, PruneMask):
                    if not item.enabled:
                        item.enable(original_weight(self.model.get_submodule(name)))
                elif isinstance(item, ScheduledWeightQuant):
                    drop = (step - sched.offset) // sched.period
                    item.bits = max(sched.target_bits, sched.start_bits - drop)
                    item.enabled = True
                else:
                    item.enabled = True

    def active(self) -> dict[str, bool]:
        """Which techniques are on at the current step."""
        return {s.technique: self.training_steps >= s.offset for s in self.state.scheduled}

    def state_dict(self) -> dict[str, int]:
        return {"training_steps": self.training_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.training_steps = int(state["training_steps"])
        self._apply()


def compression_scheduler(model: nn.Module, config: Any = None) -> CompressionScheduler:
    """The scheduler of a model prepared by `init_compression` (`config` is for DeepSpeed
    call compatibility; the wired config is used)."""
    state = _state(model)
    if config is not None and load_compression_config(config) != state.config:
        raise ValueError(
            "compression_scheduler got a different config than init_compression; pass the same"
        )
    return CompressionScheduler(model)


@torch.no_grad()
def redundancy_clean(model: nn.Module, config: Any = None) -> nn.Module:
    """Remove what enabled structured pruning masked (in place); other methods stay wired."""
    state = _state(model)
    if config is not None and load_compression_config(config) != state.config:
        raise ValueError("redundancy_clean got a different config than init_compression")
    _clean(model)
    state.scheduled = [s for s in state.scheduled if not s.technique.endswith("pruning")]
    return model
