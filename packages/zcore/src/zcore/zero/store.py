"""Where a rank's fp32 master partition, optimizer state and gradient partition live.

:class:`~zcore.zero.optimizer.ZeroOptimizer` decides *what* each rank holds (the layout of
slots, the reduction of gradients into them, clipping, publishing the new weights);
an :class:`OptimizerStore` decides *where* it is held and how the step walks it. zcore
ships :class:`MemoryStore` (on the model's device, or in host memory for ZeRO-Offload's
``device: "cpu"``); zoffload registers a store that keeps everything in NVMe swap files.
A store is chosen by ``offload_optimizer.device`` (:mod:`zcore.zero.backends`) and is
independent of the collectives (:mod:`zcore.zero.collectives`): any store combines with
any collectives.

The store sees the optimizer only through the :class:`~zcore.zero.partition.Partition` that
:meth:`OptimizerStore.attach` receives: the groups' parameters and layouts, where each
parameter sits, the stage, the accumulation dtype, the ``dp`` comm, each parameter's slot,
and stage 3's shards.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zcore.zero.layout import ParamShard

if TYPE_CHECKING:
    from zcore.zero.partition import Partition

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


class OptimizerStore(ABC):
    """The interface a store implements (see the module docstring)."""

    optimizer: torch.optim.Optimizer
    """The inner optimizer; its ``param_groups`` carry each group's hyperparameters."""

    keep_grad_partitions: bool = False
    """Set by a caller that holds every gradient of a cycle before its first reduction (the
    pipeline engine reduces once, after its schedule): stage 0-1's gradient partitions are
    then kept and zeroed between cycles, as stage 2-3's are, instead of allocated each cycle.
    Their memory stays below the cycle's peak, where partition and gradients coexist."""

    def share_params(self) -> int:
        """Let the master of every group that is the parameters themselves (one rank's
        whole fp32 group, no offload) hold them: each parameter's ``.data`` becomes a view
        of its master slot, so the step updates the model in place and publishing copies
        nothing. Returns the number of groups shared (0: this store never shares)."""
        return 0

    @abstractmethod
    def attach(self, part: Partition, make_optimizer: OptimizerFactory, hyper: list[dict]) -> None:
        """Build the master partition of every group of ``part`` (from ``part.slot_of``),
        its zero state and the inner optimizer, with ``hyper[g]`` (group ``g``'s
        hyperparameters) as its param groups."""

    # -- gradients ------------------------------------------------------------------------
    @abstractmethod
    def accumulate(self, g: int, shard: ParamShard, values: torch.Tensor, alpha: float) -> None:
        """Add ``alpha * values`` (this rank's reduced slot of one parameter) into the
        gradient partition of group ``g``."""

    @abstractmethod
    def grad_sq_norm(self, groups: Sequence[int] | None = None) -> float:
        """Sum of squares of this rank's gradient partitions of ``groups`` (default: every
        group; no collective)."""

    @abstractmethod
    def grads_nonfinite(self) -> bool:
        """Whether this rank's gradient partitions hold an inf or NaN (no collective)."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Forget the gradients of this cycle."""

    # -- step and publishing -------------------------------------------------------------
    @abstractmethod
    def update(self, coef: float) -> None:
        """Step the master partition with the gradient partitions times ``coef``. May issue
        collectives over the partition's ``comm`` (every rank calls it)."""

    @abstractmethod
    def published(self, g: int) -> torch.Tensor | None:
        """The flat tensor group ``g``'s updated weights are published from, or None when
        :meth:`update` already wrote them into the stage-3 shards."""

    @abstractmethod
    def refresh(self, p: nn.Parameter) -> None:
        """``p``'s full value was edited: take this rank's slot of it as its master."""

    # -- checkpoints ---------------------------------------------------------------------
    @abstractmethod
    def master_for_save(self) -> list[torch.Tensor]:
        """This rank's fp32 master partition of every group."""

    @abstractmethod
    def optimizer_state_for_save(self) -> dict[int, dict[str, Any]]:
        """The inner optimizer's per-group state (``state_dict()["state"]``)."""

    @abstractmethod
    def master_for_load(self) -> list[torch.Tensor]:
        """The tensors a checkpoint's master values are copied into before :meth:`finish_load`."""

    @abstractmethod
    def finish_load(self, masters: list[torch.Tensor], state: dict[str, Any] | None) -> None:
        """Adopt loaded master values and, unless ``None``, an optimizer ``state_dict``."""

    # -- accounting and life ---------------------------------------------------------------
    @property
    def live_master(self) -> list[torch.Tensor]:
        """The master tensors held in memory now (none when they live elsewhere)."""
        return []

    @abstractmethod
    def optimizer_bytes(self) -> int:
        """Memory bytes of the master and optimizer state held by this rank."""

    @abstractmethod
    def grad_bytes(self) -> int:
        """Memory bytes of this rank's gradient partitions."""

    def close(self) -> None:  # noqa: B027 - optional: only stores with files need it
        """Release what outlives the process group (swap files)."""


_NORM_CHUNK = 1 << 16


def sq_norm(t: torch.Tensor) -> float:
    """The sum of squares of ``t``, accurate to ~1e-7 relative at any size.

    ``vector_norm`` reduces in one pass without a squared temporary (10x faster than
    ``pow(2).sum()``), but one fp32 ``vector_norm`` over a whole partition drifts as it grows
    (on CPU here: -0.1% at 13M elements, -1% at 67M), which mis-scales gradient clipping.
    Rows of 64Ki elements, each normed in fp32 and summed in fp64, keep the speed (6.5 vs
    2.1 ms for 13M) and the accuracy (3e-7).
    """
    flat = t.reshape(-1)
    n = flat.numel() - flat.numel() % _NORM_CHUNK
    total = 0.0
    if n:
        rows = flat[:n].view(-1, _NORM_CHUNK)
        norms = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32)
        total += float(norms.double().pow(2).sum())
    if n < flat.numel():
        total += float(torch.linalg.vector_norm(flat[n:], dtype=torch.float32)) ** 2
    return total


class MemoryStore(OptimizerStore):
    """Master, state and gradients in memory: on the model's device, or on ``device``
    (``torch.device("cpu")`` for ZeRO-Offload), page-locked with ``pin_memory`` when a GPU
    is present."""

    def __init__(self, device: torch.device | None = None, pin_memory: bool = False) -> None:
        self.device = device
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.master: list[torch.Tensor] = []
        self.shared: set[int] = set()
        """Groups whose master is the parameters themselves (:meth:`share_params`)."""

    def attach(self, part: Partition, make_optimizer: OptimizerFactory, hyper: list[dict]) -> None:
        self.part = part
        self.master = [self._initial(g) for g in range(len(part.params))]
        self.shared = set()
        # Stage 0-1 accumulate model-sized gradients, so their partitions exist only while
        # a cycle has gradients (allocated by the first reduction, dropped after the step).
        # Stage 2-3 hold no model-sized gradient; their partitions are kept and zeroed.
        self.grads: list[torch.Tensor | None] = [None] * len(self.master)
        self._kept: list[torch.Tensor | None] = [None] * len(self.master)
        self.optimizer = make_optimizer(
            [{**h, "params": [m]} for h, m in zip(hyper, self.master, strict=True)]
        )

    def _initial(self, g: int) -> torch.Tensor:
        slots = [self.part.slot_of(p) for p in self.part.params[g]]
        device = self.device or (slots[0].device if slots else torch.device("cpu"))
        master = torch.cat(slots).to(device) if slots else torch.zeros(0, device=device)
        return master.pin_memory() if self.pin_memory and device.type == "cpu" else master

    def partition(self, g: int) -> torch.Tensor:
        """This rank's gradient partition of group ``g`` (zeros when first asked for)."""
        t = self.grads[g]
        if t is None:
            t = self._kept[g]
            if t is None:
                device = self.master[0].device if self.master else torch.device("cpu")
                numel = self.part.layouts[g].numel
                t = torch.zeros(numel, dtype=self.part.grad_accum_dtype, device=device)
                if self.part.stage >= 2 or self.keep_grad_partitions:
                    self._kept[g] = t
            else:
                t.zero_()
            self.grads[g] = t
        return t

    def share_params(self) -> int:
        return sum(self._share(g) for g in range(len(self.master)))

    def _share(self, g: int) -> bool:
        """Group ``g``'s parameters become views of its master when the master is exactly
        their values laid end to end: one slot per parameter (world 1), fp32, contiguous,
        on the master's device, not stage-3 shards, not pinned host memory."""
        ps, layout, master = self.part.params[g], self.part.layouts[g], self.master[g]
        if not ps or layout.world != 1 or self.pin_memory or g in self.shared:
            return g in self.shared
        s3 = self.part.stage3.params if self.part.stage3 is not None else {}
        at = 0
        for p, shard in zip(ps, layout.shards, strict=True):
            if (
                p in s3
                or p.dtype != torch.float32
                or p.device != master.device
                or not p.data.is_contiguous()
                or shard.offset != at
                or shard.shard_size != p.numel()
            ):
                return False
            at += p.numel()
        if at != master.numel():
            return False
        for p, shard in zip(ps, layout.shards, strict=True):
            view = master[shard.offset : shard.offset + shard.shard_size].view(p.shape)
            view.copy_(p.data)  # the same values (the master was taken from them)
            p.data = view
        self.shared.add(g)
        return True

    def accumulate(self, g: int, shard: ParamShard, values: torch.Tensor, alpha: float) -> None:
        dst = self.partition(g)[shard.offset : shard.offset + shard.shard_size]
        if values.device != dst.device:  # an offloaded partition: the copy out of the device
            values = values.to(dst.device)
        if alpha != 1.0:
            dst.add_(values, alpha=alpha)
        else:
            dst.add_(values)

    def grad_sq_norm(self, groups: Sequence[int] | None = None) -> float:
        picked = self.grads if groups is None else [self.grads[g] for g in groups]
        return sum(sq_norm(t) for t in picked if t is not None)

    def grads_nonfinite(self) -> bool:
        return any(
            t is not None and t.numel() and not bool(torch.isfinite(t).all()) for t in self.grads
        )

    def zero_grad(self) -> None:
        self.grads = [None] * len(self.master)

    def update(self, coef: float) -> None:
        for g, m in enumerate(self.master):
            gr = self.partition(g)
            m.grad = gr.float() if gr.dtype != torch.float32 else gr
            if coef != 1.0:
                m.grad.mul_(coef)
        self.optimizer.step()
        for m in self.master:
            m.grad = None

    def published(self, g: int) -> torch.Tensor:
        return self.master[g]

    def refresh(self, p: nn.Parameter) -> None:
        g, shard = self.part.where[p]
        self.master[g][shard.offset : shard.offset + shard.shard_size].copy_(self.part.slot_of(p))

    def master_for_save(self) -> list[torch.Tensor]:
        return [m.detach() for m in self.master]

    def optimizer_state_for_save(self) -> dict[int, dict[str, Any]]:
        return self.optimizer.state_dict()["state"]

    def master_for_load(self) -> list[torch.Tensor]:
        return self.master

    def finish_load(self, masters: list[torch.Tensor], state: dict[str, Any] | None) -> None:
        if state is not None:
            self.optimizer.load_state_dict(state)

    @property
    def live_master(self) -> list[torch.Tensor]:
        return self.master

    def optimizer_bytes(self) -> int:
        """A master shared with the parameters (:meth:`share_params`) is their memory:
        counted with the parameters, not here."""
        total = sum(
            m.numel() * m.element_size() for g, m in enumerate(self.master) if g not in self.shared
        )
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total

    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.grads if t is not None)
