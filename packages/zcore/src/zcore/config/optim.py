"""``optimizer``: ``{"type": ..., "params": {...}}`` with the params checked by the
model the type registered (:mod:`zcore.config.optim_registry`).

``type`` is matched case-insensitively and stored as the registered spelling; zcore's
own types are ``Adam``, ``AdamW``, ``SGD``, ``Adagrad`` and ``Lion``, whose
``params.model_dump()`` gives keyword arguments for the matching torch (or
:mod:`zcore.optim`) constructor.

DeepSpeed semantics kept: ``Adam`` with ``adam_w_mode: true`` (its default)
is AdamW, i.e. decoupled weight decay; ``AdamW`` is always decoupled.
:attr:`OptimizerConfig.decoupled_weight_decay` says which one to build.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from zcore.config._base import Bool, Float, NestedProblems, ZModel
from zcore.config.errors import MISSING, problem_at
from zcore.config.optim_registry import (
    OptimizerSpec,
    UnknownOptimizer,
    optimizer_spec,
    optimizer_types,
    register_optimizer,
)

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


class OptimizerConfig(ZModel):
    """``{"type": ..., "params": {...}}``: an optimizer type from the registry and its params,
    validated by the model that type registered."""

    type: str
    """The optimizer type, in its registered spelling (given in any case)."""
    params: SerializeAsAny[BaseModel]
    """Hyperparameters: an instance of the type's params model (``{}`` gives its defaults)."""

    @model_validator(mode="before")
    @classmethod
    def _resolve_type(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or not isinstance(data.get("type"), str):
            return data  # pydantic reports the missing or mistyped `type`
        spec = spec_of(data["type"])
        params = data.get("params", {})
        if not isinstance(params, spec.params):
            try:
                params = spec.params.model_validate(params)
            except ValidationError as error:
                raise NestedProblems(error, spec.params, "params") from None
        return {**data, "type": spec.name, "params": params}

    @classmethod
    def dynamic_blocks(cls, data: Mapping[str, Any]) -> dict[str, type[BaseModel]]:
        """The key pass checks ``params`` against the model of the type named."""
        raw = data.get("type", MISSING)
        if raw is MISSING:
            raise problem_at("type", MISSING, "is required; one of " + _choices())
        if not isinstance(raw, str):
            raise problem_at(
                "type", raw, "must be the name of an optimizer type, one of " + _choices()
            )
        return {"params": spec_of(raw).params}

    @property
    def spec(self) -> OptimizerSpec:
        """The registered spec of :attr:`type`."""
        return optimizer_spec(self.type)

    @property
    def reduces_own_gradients(self) -> bool:
        """Whether the optimizer communicates its gradients itself (as 1-bit Adam does)."""
        return self.spec.reduces_own_gradients

    @property
    def decoupled_weight_decay(self) -> bool | None:
        """True: decoupled weight decay (AdamW); False: an L2 penalty; None: not applicable."""
        rule = self.spec.decoupled_weight_decay
        return rule(self.params) if callable(rule) else rule


def spec_of(name: str) -> OptimizerSpec:
    """:func:`optimizer_spec`, its failure as a problem at ``type``."""
    try:
        return optimizer_spec(name)
    except UnknownOptimizer as error:
        raise problem_at("type", name, str(error)) from None


def _choices() -> str:
    return ", ".join(optimizer_types())


_FACTORY = "zcore.optim.factory"
for _spec in (
    OptimizerSpec(
        "Adam", AdamParams, f"{_FACTORY}:build_adam", decoupled_weight_decay=lambda p: p.adam_w_mode
    ),
    OptimizerSpec("AdamW", AdamParams, f"{_FACTORY}:build_adamw", decoupled_weight_decay=True),
    OptimizerSpec("SGD", SGDParams, f"{_FACTORY}:build_sgd", decoupled_weight_decay=False),
    OptimizerSpec(
        "Adagrad", AdagradParams, f"{_FACTORY}:build_adagrad", decoupled_weight_decay=False
    ),
    OptimizerSpec("Lion", LionParams, f"{_FACTORY}:build_lion", decoupled_weight_decay=True),
):
    register_optimizer(_spec)
