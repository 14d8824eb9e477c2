"""Mixed precision: the model's dtype and fp16's dynamic loss scaling."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossScaler:
    """DeepSpeed's dynamic loss scaler (``fp16`` block).

    The loss is multiplied by ``scale`` before backward. A step whose gradients hold an
    inf/NaN on any rank is skipped; the scale then halves (after ``hysteresis`` overflows
    in a row, unless ``consecutive_hysteresis`` resets the count on good steps) but never
    below ``min_scale``. After ``window`` good steps in a row it doubles. ``dynamic=False``
    keeps a fixed scale (``loss_scale > 0`` in the config).
    """

    scale: float = 2.0**16
    dynamic: bool = True
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    good_steps: int = 0
    hysteresis_left: int = 2
    overflows: int = 0

    @classmethod
    def from_config(cls, fp16: object) -> LossScaler:
        loss_scale = float(getattr(fp16, "loss_scale", 0.0))
        if loss_scale > 0:
            return cls(scale=loss_scale, dynamic=False)
        hyst = int(getattr(fp16, "hysteresis", 2))
        return cls(
            scale=2.0 ** int(getattr(fp16, "initial_scale_power", 16)),
            window=int(getattr(fp16, "loss_scale_window", 1000)),
            hysteresis=hyst,
            consecutive_hysteresis=bool(getattr(fp16, "consecutive_hysteresis", False)),
            min_scale=float(getattr(fp16, "min_loss_scale", 1.0)),
            hysteresis_left=hyst,
        )

    def update(self, overflow: bool) -> None:
        """Advance after a step; ``overflow`` means the step was skipped."""
        if overflow:
            self.overflows += 1
            self.good_steps = 0
            if not self.dynamic:
                return
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            return
        self.good_steps += 1
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.dynamic and self.good_steps % self.window == 0:
            self.scale *= 2.0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, float | int | bool]:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict[str, float | int | bool]) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def has_inf_or_nan(tensors: list[torch.Tensor]) -> bool:
    """Whether any element of ``tensors`` is inf or NaN (one reduction per tensor)."""
    for t in tensors:
        if t.numel() and not bool(torch.isfinite(t).all()):
            return True
    return False


def model_dtype(fp16: bool, bf16: bool) -> torch.dtype:
    if fp16 and bf16:
        raise ValueError("fp16 and bf16 are both enabled; enable at most one")
    return torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
