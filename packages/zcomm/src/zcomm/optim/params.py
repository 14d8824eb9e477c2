"""The ``optimizer.params`` of ``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb``:
DeepSpeed's keys and defaults (``deepspeed/runtime/fp16/onebit/{adam,zoadam,lamb}.py``).

Keys DeepSpeed accepts but never reads in these optimizers are accepted only at values
that change nothing, so an old config runs unchanged and nothing is silently dropped:

- ``bias_correction``: DeepSpeed stores it and never applies it (its updates are
  ``m / (sqrt(v) + eps)`` at any value); so do we, and say so here.
- ``eps_inside_sqrt`` and ``max_grad_norm``: stored, never used by DeepSpeed; we accept
  only their defaults (false, 0) and name the replacement (``gradient_clipping``).
- ``cuda_aware`` and ``comm_backend_name`` pick DeepSpeed's transport (MPI, NCCL, HCCL,
  cupy); ours is the job's ``torch.distributed`` backend (gloo, NCCL) whatever they say.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from zcore.config import OptimizerParams
from zcore.config.params_kit import Bool, Field, Float, Int, field_validator

Beta = Annotated[float, Field(ge=0, lt=1)]

NOT_CONSTRUCTOR: frozenset[str] = frozenset(
    {
        "bias_correction",
        "eps_inside_sqrt",
        "max_grad_norm",
        "amsgrad",
        "cuda_aware",
        "comm_backend_name",
    }
)


class _OneBitCommon(OptimizerParams):
    not_constructor_kwargs: ClassVar[frozenset[str]] = NOT_CONSTRUCTOR

    lr: Float = Field(1e-3, ge=0)
    """Learning rate (a scheduler, if any, overrides it each step)."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """Decay rates of the momentum and the variance."""
    eps: Float = Field(1e-8, ge=0)
    """Added to ``sqrt(v)`` in the denominator."""
    weight_decay: Float = Field(0.0, ge=0)
    """Added to the update as ``weight_decay * p`` (decoupled, as in DeepSpeed)."""
    bias_correction: Bool = True
    """Accepted as in DeepSpeed, which never applies it in these optimizers: neither do we."""
    eps_inside_sqrt: Bool = False
    """Unused by DeepSpeed; must stay false."""
    max_grad_norm: Float = Field(0.0, ge=0)
    """Unused by DeepSpeed; must stay 0 (clip with the config's ``gradient_clipping``)."""
    amsgrad: Bool = False
    """Not supported (DeepSpeed refuses it too)."""
    cuda_aware: Bool = False
    """DeepSpeed's MPI switch; the transport here is the job's torch.distributed backend."""
    comm_backend_name: Literal["nccl", "mpi", "hccl", "compressed", "gloo"] = "nccl"
    """DeepSpeed's transport name; accepted, the job's torch.distributed backend is used."""
    compressed_weight_gather: Bool = False
    """zstack's own key (DeepSpeed runs no ZeRO stage with these optimizers); OneBitAdam's
    (on there, below): ZeroOneAdam and OneBitLamb refuse it."""

    @field_validator("eps_inside_sqrt", "amsgrad")
    @classmethod
    def _must_be_false(cls, value: bool, info: object) -> bool:
        if value:
            name = getattr(info, "field_name", "this key")
            raise ValueError(
                f"{name} is not supported by the 1-bit optimizers (DeepSpeed's ignore or "
                "refuse it too); set it to false or remove it"
            )
        return value

    @field_validator("max_grad_norm")
    @classmethod
    def _no_max_grad_norm(cls, value: float) -> float:
        if value:
            raise ValueError(
                "max_grad_norm is not read by the 1-bit optimizers (nor by DeepSpeed's); "
                "remove it and set the top-level `gradient_clipping` instead"
            )
        return value


class OneBitAdamParams(_OneBitCommon):
    """``params`` of ``OneBitAdam``."""

    freeze_step: Int = Field(100000, ge=0)
    """Steps of plain Adam (full-precision gradient averaging, variance learned) before the
    variance is frozen and the momentum is averaged 1-bit compressed."""
    compressed_weight_gather: Bool = True
    """zstack's own key. At ZeRO stages 1-2 with fp32 parameters, after the freeze, each
    owner's momentum is compressed 1-bit (error feedback) and the weights' all-gather sends
    its signs and block scales; every rank replays the owners' updates bit for bit
    (:mod:`zcomm.optim.momentum_gather`): about 32x fewer bytes per step than an fp32
    all-reduce instead of 1.9x. False: the fp32 weight all-gather."""


class ZeroOneAdamParams(_OneBitCommon):
    """``params`` of ``ZeroOneAdam`` (0/1 Adam)."""

    var_freeze_step: Int = Field(100000, ge=0)
    """Steps after which the variance is frozen and local steps begin."""
    var_update_scaler: Int = Field(16, ge=1)
    """The variance is updated every ``var_interval`` steps; the interval doubles after this
    many updates."""
    local_step_scaler: Int = Field(32678, ge=1)
    """After the freeze, the interval between synchronizations doubles every this many steps."""
    local_step_clipper: Int = Field(16, ge=1)
    """The most steps between two synchronizations."""
    preconditioned: Bool = False
    """zstack's own key (false is DeepSpeed's behaviour). Before the freeze, the steps that
    skip the variance average ``g / (sqrt(v) + eps)`` 1-bit compressed and multiply the
    average back by ``sqrt(v) + eps`` (the same ``v`` on every rank at ZeRO stage 0; at
    stages 1-2 the slots' denominators are all-gathered after each variance update). One
    sign scale then fits every element: a token's embedding row that got no gradient
    receives noise in proportion to its own small variance, not the model's largest."""


class OneBitLambParams(_OneBitCommon):
    """``params`` of ``OneBitLamb``."""

    freeze_step: Int = Field(100000, ge=0)
    """Steps of plain LAMB before the compression stage."""
    max_coeff: Float = Field(10.0, gt=0)
    """Upper bound of the LAMB trust ratio."""
    min_coeff: Float = Field(0.01, ge=0)
    """Lower bound of the LAMB trust ratio."""
    coeff_beta: Float = Field(0.9, ge=0, lt=1)
    """Decay of the running trust ratio kept for the compression stage."""
    factor_max: Float = Field(4.0, gt=0)
    """Upper bound of the compression stage's trust-ratio correction factor."""
    factor_min: Float = Field(0.5, ge=0)
    """Lower bound of the correction factor."""
    factor_threshold: Float = Field(0.1, ge=0)
    """Largest relative change of the correction factor from one step to the next."""
