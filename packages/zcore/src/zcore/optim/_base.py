"""Shared machinery of the native CPU optimizers: validation, state layout
compatible with ``torch.optim``, and a step that checks everything first."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zcore.optim._buffers import check_like, check_param, new_state, state_dtype_arg

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


class TorchStateCompat(torch.optim.Optimizer):
    """Lets a state dict saved by the matching ``torch.optim`` optimizer load: group
    keys torch does not save (ours) are filled in from ``defaults``."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)


class NativeOptimizer(TorchStateCompat):
    """Base class: subclasses name their state tensors and run one kernel per parameter."""

    #: names of the per-parameter state tensors, as torch.optim names them
    state_keys: tuple[str, ...] = ()

    def __init__(self, params: ParamsT, defaults: dict[str, Any], state_dtype: torch.dtype):
        self.state_dtype = state_dtype_arg(state_dtype)
        self._check_group(defaults, "defaults")
        super().__init__(params, defaults)

    # -- subclass hooks -------------------------------------------------
    def _check_group(self, group: dict[str, Any], where: str) -> None:
        """Raise ValueError naming the field if a hyperparameter is invalid."""

    def initial_state_value(self, key: str, group: dict[str, Any]) -> float:
        """The value state tensor ``key`` of a parameter in ``group`` starts at (states
        built elsewhere, such as NVMe swap files, start from it too)."""
        return 0.0

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {
            k: new_state(p, self.state_dtype, fill=self.initial_state_value(k, group))
            for k in self.state_keys
        }

    def _kernel(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        step: int,
    ) -> None:
        raise NotImplementedError

    # -- torch.optim.Optimizer ------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        self._check_group(group, f"param_groups[{gi}]")
        for pi, p in enumerate(group["params"]):
            check_param(p, f"param_groups[{gi}].params[{pi}]")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by this optimizer or by the matching ``torch.optim`` one."""
        super().load_state_dict(state_dict)
        # torch casts loaded states to the parameter dtype; put them back in ours.
        for state in self.state.values():
            for key in self.state_keys:
                if key in state:
                    loaded = state[key]
                    state[key] = new_state(loaded, self.state_dtype).copy_(loaded)
            if "step" in state and not torch.is_tensor(state["step"]):
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter that has a gradient.

        All parameters, gradients, states and hyperparameters are checked before
        the first one is updated: an invalid step raises and changes nothing.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, f"param_groups[{gi}]")
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"param_groups[{gi}].params[{pi}]"
                check_param(p, where)
                check_like(p.grad, p, "grad", where)
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p, group))
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                for key in self.state_keys:
                    check_like(state[key], p, f"state[{key!r}]", where)
                work.append((p, state, group))
        for p, state, group in work:
            step = int(state["step"].item()) + 1
            self._kernel(p, p.grad, state, group, step)
            state["step"].fill_(step)
        return loss


def check_range(where: str, name: str, value: float, lo: float, hi: float | None = None) -> None:
    """Raise ValueError unless ``lo <= value`` (and ``value < hi`` when given)."""
    ok = value >= lo and (hi is None or value < hi)
    if not ok or value != value:
        bound = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{where}: invalid {name} = {value}; expected a value {bound}")


def check_adam_group(group: dict[str, Any], where: str, who: str) -> None:
    """Validate an Adam/AdamW param group (or the defaults) of optimizer ``who``."""
    check_range(where, "lr", float(group["lr"]), 0.0)
    check_range(where, "eps", float(group["eps"]), 0.0)
    check_range(where, "weight_decay", float(group["weight_decay"]), 0.0)
    beta1, beta2 = group["betas"]
    check_range(where, "betas[0]", float(beta1), 0.0, 1.0)
    check_range(where, "betas[1]", float(beta2), 0.0, 1.0)
    if group.get("amsgrad"):
        raise ValueError(f"{where}: amsgrad=True is not supported by {who}; use torch.optim.Adam")
