"""``optimizer``: ``{"type": ..., "params": {...}}`` with the params checked per type.

``type`` is matched case-insensitively and stored as ``Adam``, ``AdamW``,
``SGD``, ``Adagrad`` or ``Lion``. ``params.model_dump()`` gives keyword
arguments for the matching torch (or :mod:`zcore.optim`) constructor.

DeepSpeed semantics kept: ``Adam`` with ``adam_w_mode: true`` (its default)
is AdamW, i.e. decoupled weight decay; ``AdamW`` is always decoupled.
:attr:`AdamConfig.decoupled_weight_decay` says which one to build.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, Tag, field_validator, model_validator

from zcore.config._base import Bool, Float, TypedBlock, ZModel, empty_block, type_discriminator
from zcore.config.errors import problem_at

#: The optimizer types zstack provides, in their canonical spelling.
OPTIMIZER_TYPES = ("Adam", "AdamW", "SGD", "Adagrad", "Lion")

Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimizerParams(ZModel):
    """Base of the per-type ``params`` blocks."""

    #: Fields that configure zstack rather than the optimizer; left out of :meth:`model_dump`.
    not_constructor_kwargs: ClassVar[frozenset[str]] = frozenset()

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """Keyword arguments for the optimizer's constructor (``betas`` as a tuple).

        The config itself (``ZConfig.to_dict``) still records every field.
        """
        dumped = super().model_dump(**kwargs)
        for key in self.not_constructor_kwargs:
            dumped.pop(key, None)
        return dumped


class AdamParams(OptimizerParams):
    """``params`` of ``Adam`` and ``AdamW``."""

    not_constructor_kwargs: ClassVar[frozenset[str]] = frozenset({"adam_w_mode", "torch_adam"})

    lr: Float = Field(1e-3, ge=0)
    """Learning rate (a scheduler, if any, overrides it each step)."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates, each in [0, 1)."""
    eps: Float = Field(1e-8, ge=0)
    """Added to the denominator for numerical stability."""
    weight_decay: Float = Field(0.0, ge=0)
    """Weight decay; decoupled (AdamW) or L2 (Adam), see ``decoupled_weight_decay``."""
    amsgrad: Bool = False
    """AMSGrad variant; not supported, must be false."""
    adam_w_mode: Bool = True
    """DeepSpeed's switch: with type ``Adam``, true (the default) means AdamW's decoupled weight
    decay and false means L2 regularization. Ignored for type ``AdamW`` (always decoupled)."""
    torch_adam: Bool = False
    """DeepSpeed's switch for using ``torch.optim.Adam``; accepted, the implementation is
    zstack's choice either way."""

    @field_validator("amsgrad")
    @classmethod
    def _no_amsgrad(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "amsgrad is not supported by zstack's Adam; set it to false or remove it"
            )
        return value


class SGDParams(OptimizerParams):
    """``params`` of ``SGD``."""

    lr: Float = Field(1e-3, ge=0)
    """Learning rate (torch's default; DeepSpeed has none)."""
    momentum: Float = Field(0.0, ge=0)
    """Momentum factor."""
    dampening: Float = Field(0.0, ge=0)
    """Dampening for momentum."""
    weight_decay: Float = Field(0.0, ge=0)
    """L2 penalty."""
    nesterov: Bool = False
    """Nesterov momentum; needs momentum > 0 and dampening 0."""

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDParams:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise problem_at(
                "nesterov",
                True,
                f"Nesterov momentum needs momentum > 0 and dampening 0 (momentum is "
                f"{self.momentum}, dampening {self.dampening})",
            )
        return self


class AdagradParams(OptimizerParams):
    """``params`` of ``Adagrad``."""

    lr: Float = Field(1e-2, ge=0)
    """Learning rate."""
    eps: Float = Field(1e-10, ge=0)
    """Added to the denominator for numerical stability."""
    weight_decay: Float = Field(0.0, ge=0)
    """L2 penalty."""
    lr_decay: Float = Field(0.0, ge=0)
    """Learning-rate decay per step."""
    initial_accumulator_value: Float = Field(0.0, ge=0)
    """Starting value of the sum of squared gradients."""


class LionParams(OptimizerParams):
    """``params`` of ``Lion``."""

    lr: Float = Field(1e-4, ge=0)
    """Learning rate."""
    betas: tuple[Beta, Beta] = (0.9, 0.99)
    """Interpolation factors of the update and of the momentum, each in [0, 1)."""
    weight_decay: Float = Field(0.0, ge=0)
    """Decoupled weight decay."""


class AdamConfig(TypedBlock):
    """``{"type": "Adam"}``: AdamW unless ``params.adam_w_mode`` is false (DeepSpeed's rule)."""

    type: Literal["Adam"]
    """The optimizer type."""
    params: AdamParams = Field(default_factory=empty_block)
    """Hyperparameters."""

    @property
    def decoupled_weight_decay(self) -> bool:
        """True: build AdamW (decoupled weight decay); False: Adam with L2 regularization."""
        return self.params.adam_w_mode


class AdamWConfig(TypedBlock):
    """``{"type": "AdamW"}``: Adam with decoupled weight decay."""

    type: Literal["AdamW"]
    """The optimizer type."""
    params: AdamParams = Field(default_factory=empty_block)
    """Hyperparameters (``adam_w_mode`` is ignored, as in DeepSpeed)."""

    @property
    def decoupled_weight_decay(self) -> bool:
        """Always True for AdamW."""
        return True


class SGDConfig(TypedBlock):
    """``{"type": "SGD"}``."""

    type: Literal["SGD"]
    """The optimizer type."""
    params: SGDParams = Field(default_factory=empty_block)
    """Hyperparameters."""

    @property
    def decoupled_weight_decay(self) -> bool:
        """False: SGD's weight decay is an L2 penalty."""
        return False


class AdagradConfig(TypedBlock):
    """``{"type": "Adagrad"}``."""

    type: Literal["Adagrad"]
    """The optimizer type."""
    params: AdagradParams = Field(default_factory=empty_block)
    """Hyperparameters."""

    @property
    def decoupled_weight_decay(self) -> bool:
        """False: Adagrad's weight decay is an L2 penalty."""
        return False


class LionConfig(TypedBlock):
    """``{"type": "Lion"}``."""

    type: Literal["Lion"]
    """The optimizer type."""
    params: LionParams = Field(default_factory=empty_block)
    """Hyperparameters."""

    @property
    def decoupled_weight_decay(self) -> bool:
        """True: Lion's weight decay is decoupled."""
        return True


OptimizerConfig = Annotated[
    Annotated[AdamConfig, Tag("Adam")]
    | Annotated[AdamWConfig, Tag("AdamW")]
    | Annotated[SGDConfig, Tag("SGD")]
    | Annotated[AdagradConfig, Tag("Adagrad")]
    | Annotated[LionConfig, Tag("Lion")],
    type_discriminator(OPTIMIZER_TYPES),
]
"""The ``optimizer`` block; ``.type``, ``.params`` and ``.decoupled_weight_decay`` on every member."""
