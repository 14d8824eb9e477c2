"""The training engine that ``zcore.initialize`` returns.

It wraps the user's model and drives one training step as DeepSpeed's engine does::

    loss = engine(batch)        # forward (stage 3 gathers parameters module by module)
    engine.backward(loss)       # scaled backward; gradients reduced into partitions
    engine.step()               # at an accumulation boundary: clip, step, publish

The engine wires parts that :mod:`zcore.builders` makes from the config (the mesh's axes,
the parameters placed on it, the ZeRO optimizer with its store and collectives; the
partitioning itself lives in :mod:`zcore.zero`). What a checkpoint saves is handed to
:mod:`zcore.checkpoint` as parts (:meth:`ZEngine.checkpoint_parts`), nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zcore.builders import (
    build_zero_optimizer,
    param_groups,
    place_parameters,
    unique_named_parameters,
)
from zcore.comm import MeshSpec, mesh_for_config
from zcore.comm.accounting import Traffic, TrafficTally
from zcore.config import ZConfig
from zcore.engine_parts import Counters, ModelState, RankLocalState
from zcore.lr_schedules.attach import engine_random_ltd, engine_scheduler
from zcore.monitor import MonitorMaster
from zcore.precision import LossScaler, model_dtype
from zcore.sequence.attention import configure_modes
from zcore.tensor.cut import cuts_json
from zcore.tensor.parallelize import parallelize_for_config
from zcore.zero.axes import bind_model, group_axes, mesh_request
from zcore.zero.collectives import collectives_for
from zcore.zero.sharded_state import OptimizerShards
from zcore.zero.stage3 import Stage3Params

if TYPE_CHECKING:
    from zcore.checkpoint.parts import CheckpointParts

log = logging.getLogger("zcore")

__all__ = ["ZEngine", "unique_named_parameters"]


def _counter(name: str) -> property:
    def get(self: ZEngine) -> int:
        return getattr(self.counters, name)

    def put(self: ZEngine, value: int) -> None:
        setattr(self.counters, name, value)

    return property(get, put, doc=f"``counters.{name}``")


class ZEngine:
    """A model under ZeRO data parallelism (see the module docstring)."""

    global_steps = _counter("global_steps")
    micro_steps = _counter("micro_steps")
    global_samples = _counter("global_samples")
    skipped_steps = _counter("skipped_steps")

    def __init__(
        self,
        model: nn.Module,
        config: ZConfig,
        optimizer: torch.optim.Optimizer | None = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        mesh: MeshSpec | None = None,
    ) -> None:
        self.config = config
        zc = config.zero_optimization
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        self.mesh = mesh_for_config(config, device, mesh_request(model).get("ep", 1), mesh)
        parallelize_for_config(model, config, self.mesh)  # tensor_parallel.autotp_size
        bind_model(model, self.mesh)
        configure_modes(model, config.sequence_parallel_mode)
        self.axes = group_axes(self.mesh)
        """The axes a parameter group is sharded over: ``dp``, ``edp`` (experts)."""
        self.comm = self.mesh.comm("dp")
        """Collectives over the ZeRO axis (what stages 1-3 shard across)."""
        self.replicas = self.mesh.comm("dp_replicate")
        """Collectives across replicas of the ZeRO partition (size 1 unless MiCS)."""
        self.world_comm = self.mesh.comm("world")
        self.rank = self.mesh.rank
        self.data_rank = self.mesh.data_rank
        """This rank's index among the ranks that read different data."""
        self.world_size = self.mesh.spec.data_parallel
        """Data-parallel ranks (``dp_replicate x dp``): the batch arithmetic's world size."""
        self.batch = config.batch_sizes(self.world_size)
        self.stage = zc.stage
        self.dtype = model_dtype(config.fp16.enabled, config.bf16.enabled)
        self.module = model
        self.random_ltd = engine_random_ltd(config, self)  # data_efficiency.data_routing
        self.scaler = LossScaler.from_config(config.fp16) if config.fp16.enabled else None
        self.counters = Counters(on_load=self.mesh.set_step)
        """The step counters (a checkpoint part; ``global_steps`` etc. read them)."""
        self._no_sync = False
        self._sync = True
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}

        self.collectives = collectives_for(config, self.mesh)
        named = unique_named_parameters(model)
        self.stage3: Stage3Params | None = place_parameters(
            model, config, named, self.axes, self.collectives, self.dtype, self.mesh.spec.ep
        )
        self.zopt = build_zero_optimizer(
            config,
            param_groups(named, optimizer, model_parameters),
            {p: n for n, p in named},
            self.axes,
            optimizer,
            self.dtype,
            self.stage3,
            self.collectives,
        )
        self.optimizer = self.zopt.optimizer
        # Kept so that destroy() can take them off again: each one holds this engine, and
        # a stale one would keep taking the gradients of an engine that wraps the model next.
        self._grad_hooks: list[RemovableHandle] = []
        for ps in self.zopt.params:
            for p in ps:
                self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
                p._z_on_edit = [self.zopt.refresh_master]  # type: ignore[attr-defined]
        self.lr_scheduler = engine_scheduler(config, self.optimizer, lr_scheduler, self.random_ltd)
        self.monitor = MonitorMaster(
            config.csv_monitor.model_dump(), config.tensorboard.model_dump(), rank=self.rank
        )
        # bytes sent per optimizer step: the mesh's tally at the last boundary, and the delta
        self._traffic_mark = self.mesh.traffic()
        self._step_traffic = TrafficTally()

    # -- the training step ----------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model; floating-point tensor inputs are cast to the model's dtype."""
        cast = self._cast_input
        start = time.perf_counter()
        out = self.module(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})
        self._times["forward"] += time.perf_counter() - start
        return out

    def _cast_input(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.dtype:
            return x.to(self.dtype)
        return x

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` ends an accumulation cycle (and steps the optimizer)."""
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of ``loss`` scaled by the loss scale and 1/accumulation steps.

        Gradients are reduced during this call at stage 2-3 on every micro-step, at stage
        0-1 on the boundary micro-step, and never inside :meth:`no_sync`.
        """
        boundary = self.is_gradient_accumulation_boundary()
        self._sync = not self._no_sync and (self.stage >= 2 or boundary)
        self.mesh.set_step(self.global_steps)
        scale = (self.scaler.scale if self.scaler else 1.0) / self.batch.gradient_accumulation_steps
        start = time.perf_counter()
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        if self._sync:
            self.zopt.finish_reduction()
        if self.stage3 is not None:
            self.stage3.end_backward()
        self._times["backward"] += time.perf_counter() - start

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._sync:
            self.zopt.on_grad(p)  # type: ignore[arg-type]
        if self.stage3 is not None:
            self.stage3.release([p])  # type: ignore[list-item]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside this block, at any stage.

        The gradients are reduced with the next backward outside the block or, at the
        latest, by the next optimizer ``step()``.
        """
        prev, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = prev

    def step(self) -> None:
        """Count a micro-step; at an accumulation boundary update the weights."""
        self.micro_steps += 1
        self.global_samples += self.batch.micro_batch_size * self.world_size
        if self.micro_steps % self.batch.gradient_accumulation_steps:
            return
        self.mesh.set_step(self.global_steps)
        start = time.perf_counter()
        self.zopt.reduce_leftovers()
        overflow = self.scaler is not None and self.zopt.grads_overflow()
        if overflow:
            assert self.scaler is not None
            old = self.scaler.scale
            self.scaler.update(True)
            self.skipped_steps += 1
            if self.rank == 0:
                log.warning(
                    "step %d: fp16 gradient overflow, step skipped; loss scale %g -> %g",
                    self.global_steps,
                    old,
                    self.scaler.scale,
                )
        else:
            inv = 1.0 / self.scaler.scale if self.scaler else 1.0
            self.zopt.step(inv, float(self.config.gradient_clipping))
            if self.scaler is not None:
                self.scaler.update(False)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.zopt.zero_grad()
        self.global_steps += 1
        self.mesh.set_step(self.global_steps)
        self._times["step"] += time.perf_counter() - start
        now = self.mesh.traffic()
        self._step_traffic, self._traffic_mark = now.minus(self._traffic_mark), now
        self._write_monitor()
        if self.global_steps % self.config.steps_per_print == 0:
            self._print_progress()

    def _print_progress(self) -> None:
        """DeepSpeed-style periodic line (rank 0), with the time breakdown if configured."""
        if self.rank != 0:
            return
        norm = self.zopt.last_grad_norm
        parts = [f"step {self.global_steps}", f"lr {self.get_lr()[0]:.3g}"]
        if norm is not None:
            parts.append(f"grad_norm {norm:.4g}")
        if self.scaler is not None:
            parts.append(f"loss_scale {self.scaler.scale:g} (skipped {self.skipped_steps})")
        sent = self.comm_bytes_last_step()
        if sent.total:
            parts.append(
                f"sent intra {sent.intra / 2**20:.3g} MiB inter {sent.inter / 2**20:.3g} MiB"
            )
        if self.config.wall_clock_breakdown:
            n = self.config.steps_per_print
            parts += [f"{k} {1000 * v / n:.1f} ms/step" for k, v in self._times.items()]
        log.info(" | ".join(parts))
        self._times = dict.fromkeys(self._times, 0.0)

    def _write_monitor(self) -> None:
        events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
        if self.scaler is not None:
            events.append(("Train/Samples/loss_scale", self.scaler.scale, self.global_samples))
        if self.zopt.last_grad_norm is not None:
            events.append(
                ("Train/Samples/grad_norm", self.zopt.last_grad_norm, self.global_samples)
            )
        sent = self.comm_bytes_last_step()
        events.append(("Train/Samples/comm_bytes_intra", sent.intra, self.global_samples))
        events.append(("Train/Samples/comm_bytes_inter", sent.inter, self.global_samples))
        self.monitor.write_events(events)

    def comm_bytes_last_step(self) -> Traffic:
        """Bytes this rank sent during the last optimizer step, intra-node and inter-node.

        Everything the mesh's collectives carried between the previous optimizer step's end
        and this one's (every micro-step's reduction, stage 3's gathers, the optimizer's own
        communication, and any forward run in between, e.g. an evaluation); per op kind in
        :meth:`comm_traffic_last_step`. The model is :mod:`zcore.comm.accounting`'s.
        """
        return self._step_traffic.total

    def comm_traffic_last_step(self) -> TrafficTally:
        """:meth:`comm_bytes_last_step` per op kind (``all_reduce``, ``all_gather``, ...)."""
        return self._step_traffic

    def zero_grad(self) -> None:
        """Drop gradients held by the model; partitions are cleared only between cycles."""
        for p in self.module.parameters():
            p.grad = None
        if self.micro_steps % self.batch.gradient_accumulation_steps == 0:
            self.zopt.zero_grad()

    # -- queries --------------------------------------------------------------------------
    def train(self, mode: bool = True) -> ZEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZEngine:
        return self.train(False)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (all partitions, unscaled, before clipping) of the last step."""
        return self.zopt.last_grad_norm

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: parameters, gradients, optimizer state (master included)."""
        seen: set[int] = set()
        params = 0
        for p in self.module.parameters():
            if p.untyped_storage().data_ptr() not in seen and p.numel():
                seen.add(p.untyped_storage().data_ptr())
                params += p.untyped_storage().nbytes()
        if self.stage3 is not None:
            params += sum(
                sp.shard.numel() * sp.shard.element_size() for sp in self.stage3.params.values()
            )
        grads = self.zopt.grad_bytes() + sum(
            p.grad.numel() * p.grad.element_size()
            for p in self.module.parameters()
            if p.grad is not None
        )
        return {"params": params, "grads": grads, "optimizer": self.zopt.optimizer_bytes()}

    def destroy(self) -> None:
        """Remove hooks and close monitors (the process group stays up).

        Afterwards the model holds no reference to this engine, so its master weights and
        optimizer state can be freed, and at stages 0-2 the same model can be wrapped by a
        new engine.
        """
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()
        for ps in self.zopt.params:
            for p in ps:
                edit = getattr(p, "_z_on_edit", None)
                if edit == [self.zopt.refresh_master]:  # not a later engine's
                    del p._z_on_edit  # type: ignore[attr-defined]
        if self.stage3 is not None:
            self.stage3.remove_hooks()
            # a zero.Init-built Stage3Params outlives this engine (the parameters hold it)
            if self.zopt.refresh_master in self.stage3.on_repartition:
                self.stage3.on_repartition.remove(self.zopt.refresh_master)
            self.stage3.store.close()
        self.zopt.close()
        self.monitor.close()

    # -- checkpoints ----------------------------------------------------------------------
    def state_parts(self) -> dict[str, Any]:
        """The parts a checkpoint saves whole through ``state_dict`` / ``load_state_dict``
        (the master weights and optimizer state are sharded by the store instead):
        ``lr_scheduler`` and ``loss_scaler`` when the engine has them."""
        parts: dict[str, Any] = {}
        if self.lr_scheduler is not None:
            parts["lr_scheduler"] = self.lr_scheduler
        if self.scaler is not None:
            parts["loss_scaler"] = self.scaler
        return parts

    def checkpoint_parts(self) -> CheckpointParts:
        """Everything :mod:`zcore.checkpoint` saves and loads, and this rank's place."""
        from zcore.checkpoint.parts import CheckpointParts, RankPlace

        mesh = self.mesh
        place = RankPlace(
            rank=self.rank,
            world=mesh.spec.world,
            data_world=self.world_size,
            coords=mesh.full_coords(),
            mesh=mesh.describe(),
            comm=self.world_comm,
        )
        zopt = self.zopt
        return CheckpointParts(
            place=place,
            counters=self.counters,
            sharded=OptimizerShards(zopt),
            model=ModelState(
                self.module, lambda: {id(p) for ps in zopt.params for p in ps}, self.stage3
            ),
            per_rank=RankLocalState(lambda: zopt.communicator, self.collectives, mesh.spec.world),
            whole=self.state_parts(),
            info={
                "stage": self.stage,
                "dtype": str(self.dtype).removeprefix("torch."),
                "config": self.config.to_dict(),
                "tp_cuts": cuts_json(self.module.named_parameters()),
            },
        )

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Rank 0 writes the full model in its training dtype as one plain ``state_dict``.

        Collective. At stage 3 the parameters must be gathered, which the config has to
        allow with ``zero_optimization.stage3_gather_16bit_weights_on_model_save: true``
        (as in DeepSpeed); without it this raises instead of writing nothing.
        """
        from zcore.checkpoint.model16 import save_16bit_model

        zc = self.config.zero_optimization
        if self.stage == 3 and not zc.stage3_gather_16bit_weights_on_model_save:
            raise ValueError(
                "save_16bit_model at ZeRO stage 3 gathers every parameter; set "
                "`zero_optimization.stage3_gather_16bit_weights_on_model_save: true`, or use "
                "save_checkpoint + `z checkpoint consolidate`"
            )
        return save_16bit_model(self.checkpoint_parts(), save_dir, save_filename)

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
    ) -> str:
        """Write this rank's shard and (rank 0) the manifest under ``save_dir/tag`` atomically."""
        from zcore.checkpoint import save

        return save(self.checkpoint_parts(), save_dir, tag, client_state or {}, save_latest)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
    ) -> tuple[str, dict]:
        """Load ``load_dir/tag`` (default: the ``latest`` pointer), from any world size.

        Returns ``(path, client_state)``.
        """
        from zcore.checkpoint import load

        parts = self.checkpoint_parts()
        return load(parts, load_dir, tag, load_optimizer_states, load_lr_scheduler_states)
