"""DeepSpeed's learning-rate schedules as ``torch.optim.lr_scheduler.LRScheduler`` subclasses.

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` and ``OneCycle`` take DeepSpeed's
parameter names (the ``scheduler.params`` block of a DeepSpeed config) and compute
DeepSpeed's formulas, while behaving like any torch scheduler: ``step()``,
``get_last_lr()``, ``state_dict()`` / ``load_state_dict()``.

Step convention, DeepSpeed's (``deepspeed/runtime/lr_schedules.py``, 0.19.8):
``scheduler.last_epoch`` (also readable as ``last_batch_iteration``) is the index of the
last batch done. A new schedule (``last_batch_iteration=-1``) stays at -1 and sets the
optimizer to the value DeepSpeed's constructors set: ``warmup_min_lr`` (``WarmupLR``,
``WarmupDecayLR``), 0 (``WarmupCosineLR``), ``cycle_min_lr`` and ``cycle_min_mom``
(``OneCycle``). Each ``step()``, called after each optimizer step as DeepSpeed's engine
does, advances one iteration and applies the schedule there. So optimizer step 1 runs
at that starting value and step ``k >= 2`` at the schedule's iteration ``k - 2``, the
learning rates a DeepSpeed run uses.

``last_batch_iteration=n >= 0`` resumes after batch ``n``: the optimizer gets the values
an uninterrupted run holds then (iteration ``n``) and the next ``step()`` applies
iteration ``n + 1``. DeepSpeed's constructors leave the optimizer's lr alone instead, so
that its first resumed step runs at whatever the optimizer holds (the config's lr unless
a checkpoint's optimizer state is loaded); with that state loaded, as checkpoint resumes
do, the two are the same. ``state_dict()`` is DeepSpeed's ``{"last_batch_iteration": n}``;
``load_state_dict()`` restores the position only, as DeepSpeed's (the schedule's
parameters stay the constructor's), sets the optimizer to that position's values (what
its restored state holds anyway) and also takes the ``last_epoch`` of older zcore
checkpoints.

``LayerTokenLR`` (random-LTD's LayerToken schedule) is not a ``"scheduler"`` type: the
``data_efficiency.data_routing.random_ltd.layer_token_lr_schedule`` block builds it, since
it needs the run's layer-token count (``zcore.lr_schedules.layer_token``).
"""

from zcore.lr_schedules.factory import SCHEDULERS, build_scheduler
from zcore.lr_schedules.layer_token import LayerTokenLR
from zcore.lr_schedules.one_cycle import OneCycle
from zcore.lr_schedules.warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "SCHEDULERS",
    "LayerTokenLR",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]
