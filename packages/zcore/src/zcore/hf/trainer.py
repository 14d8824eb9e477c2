"""``zcore.hf.Trainer``: transformers' ``Trainer`` with zcore's ZeRO engine in DeepSpeed's place.

A DeepSpeed user's fine-tuning script moves over by one line::

    trainer = zcore.hf.Trainer(model=model, args=args, train_dataset=ds, config="ds_config.json")

The ``config=`` is DeepSpeed's JSON (ZeRO stage 0-3, offload, fp16/bf16, ``optimizer`` and
``scheduler`` blocks); its ``"auto"`` values come from ``TrainingArguments`` and a real
conflict is an error naming both values (:mod:`zcore.hf.trainer_config`). Everything else is
transformers' own loop: data loading and sharding, callbacks, logging, evaluation,
``checkpoint-N`` folders with ``trainer_state.json`` and RNG state.

Where it hooks in, the places transformers' DeepSpeed integration uses
(``integrations/deepspeed.py``: ``deepspeed_init``, ``DeepSpeedEngineWrapper``):

- ``_prepare_for_training``: builds the engine with ``zcore.initialize`` over the model (at
  stage 3 typically built partitioned by ``zcore.hf.from_pretrained``); without an
  ``optimizer``/``scheduler`` block the Trainer's own optimizer (``create_optimizer``: AdamW
  with its no-decay groups) and schedule (``create_scheduler``) are handed to the engine. On
  resume it loads the engine checkpoint in the ``checkpoint-N`` folder (any world size).
- ``training_step``: ``engine.backward`` then ``engine.step`` for every micro-batch, the
  engine reducing, clipping and stepping at the accumulation boundary; the loop's later
  ``optimizer.step()``/``lr_scheduler.step()`` are no-ops (:mod:`zcore.hf.trainer_shims`).
- ``_clip_grad_norm``/``_get_grad_norm``: the engine's global norm of the step.
- ``save_model``: ``zcore.hf.save_pretrained`` (collective; gathers one parameter at a time);
  for a PEFT model the adapter directory only (:mod:`zcore.hf.trainer_peft`).
- ``_save_optimizer_and_scheduler``: ``engine.save_checkpoint(checkpoint-N, "global_stepN")``.
- ``_load_from_checkpoint``: nothing; the engine checkpoint holds the weights.
- ``tensor_parallel.autotp_size`` T > 1: the model is cut over ``tp`` before the optimizer is
  made and the T ranks of a data rank read the same batches (:mod:`zcore.hf.trainer_tp`).
- ``_load_best_model`` (``load_best_model_at_end``): the engine checkpoint in the best
  ``checkpoint-N`` folder, weights and optimizer state, as DeepSpeed's integration loads it.

This module imports transformers (the only zcore module that does); ``import zcore.hf`` does
not load it until ``zcore.hf.Trainer`` is used. Requires transformers 5.x (``pip install zcore[hf]``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn

from zcore.comm import CollectiveError
from zcore.hf.trainer_config import (
    TrainerConfigError,
    check,
    data_world,
    fill_from_args,
    finalize,
    load_config,
    tp_size,
)
from zcore.hf.trainer_peft import is_peft_model, save_adapter
from zcore.hf.trainer_shims import EngineOptimizer, EngineScheduler
from zcore.hf.trainer_tp import cut_model, share_batches_over_tp

TRAINING_ARGS_NAME = "training_args.bin"


class Trainer(transformers.Trainer):
    """transformers' ``Trainer`` on zcore's ZeRO engine; ``config=`` is the ZeRO config.

    Takes every argument ``transformers.Trainer`` takes, plus ``config``: DeepSpeed's config
    as a dict or the path of a JSON file. ``TrainingArguments(deepspeed=...)`` must not be set.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: transformers.TrainingArguments | None = None,
        *rest: Any,
        config: dict | str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if args is not None and getattr(args, "deepspeed", None):
            raise TrainerConfigError(
                f"TrainingArguments(deepspeed={args.deepspeed!r}) is set as well as "
                "zcore.hf.Trainer's config=; zcore replaces DeepSpeed: drop deepspeed= from "
                "TrainingArguments and pass the same ds_config as config="
            )
        if config is None:
            raise TrainerConfigError(
                "zcore.hf.Trainer needs config=: a ZeRO config dict or the path of a "
                'ds_config.json (e.g. {"zero_optimization": {"stage": 2}})'
            )
        if args is None:
            args = transformers.TrainingArguments(output_dir="tmp_trainer")
        if args.load_best_model_at_end and args.save_only_model:
            raise TrainerConfigError(
                "load_best_model_at_end=True with save_only_model=True: the best model is "
                "loaded from the engine checkpoint in its checkpoint-N folder, which "
                "save_only_model leaves out; set save_only_model=False (as for DeepSpeed)"
            )
        self.zero_config = fill_from_args(load_config(config), args)
        """The config after ``TrainingArguments`` filled its ``"auto"`` values."""
        check(self.zero_config, args, _hidden_size(model))
        self.engine: Any = None
        """The ``ZEngine`` once ``train()`` has built it."""
        self.tp = tp_size(self.zero_config)
        """``tensor_parallel.autotp_size``: ranks each layer is cut over (the model is cut when
        training starts; :mod:`zcore.hf.trainer_tp`)."""
        super().__init__(model, args, *rest, **kwargs)
        if self.tp > 1:
            share_batches_over_tp(self.accelerator, self.tp)

    def get_tp_size(self) -> int:
        """The config's ``tensor_parallel.autotp_size`` (transformers divides it out of the
        token counts and loss scale it sums over every process)."""
        return getattr(self, "tp", 1)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``train``. A collective of the Trainer's own loop (accelerate's
        gathers of token counts and losses) that fails because a peer rank died is re-raised
        as zcore's :class:`~zcore.comm.CollectiveError` naming this rank and the step, as the
        engine's own collectives are."""
        try:
            return super().train(*args, **kwargs)
        except RuntimeError as err:
            if isinstance(err, CollectiveError) or not _peer_failure(err):
                raise
            rank, world = dist.get_rank(), dist.get_world_size()
            step = self.state.global_step
            raise CollectiveError(
                f"rank {rank}/{world}: a collective of the Trainer's loop at step {step} "
                f"failed: {type(err).__name__}: {err}\nanother rank may have died; check the "
                "other ranks' logs for the first error"
            ) from err

    # -- building the engine ------------------------------------------------------------
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # The engine owns precision (the config's fp16/bf16 blocks, filled from the
        # arguments): accelerate must neither autocast the forward nor scale the loss.
        built = super()._build_accelerator_args(**kwargs)
        built["mixed_precision"] = "no"
        return built

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> tuple[nn.Module, Any]:
        import zcore

        if self.engine is not None:  # a second train(): a fresh engine over the same model
            self.engine.destroy()
            self.engine = None
        _check_whole_cycles(
            train_dataloader, self.args, max_steps, data_world(self.zero_config, self.args)
        )
        config = finalize(self.zero_config, self.args, _hidden_size(self.model), max_steps)
        if self.tp > 1:  # before the optimizer is made: it must hold the shards
            cut_model(self.model, config)
        optimizer = self.optimizer if not isinstance(self.optimizer, EngineOptimizer) else None
        if optimizer is None and "optimizer" not in config:
            self.optimizer = None
            optimizer = self.create_optimizer()
        elif optimizer is not None and "optimizer" in config:
            raise TrainerConfigError(
                "an optimizer was passed (Trainer(optimizers=...)) and the config has an "
                "`optimizer` block; drop one of them"
            )
        scheduler: Any = self.lr_scheduler
        if isinstance(scheduler, EngineScheduler) or self._created_lr_scheduler:
            scheduler, self.lr_scheduler, self._created_lr_scheduler = None, None, False
        if scheduler is None and "scheduler" not in config:

            def scheduler(opt: torch.optim.Optimizer) -> Any:
                self.lr_scheduler = None
                return self.create_scheduler(num_training_steps=max_steps, optimizer=opt)

        engine, _, _, _ = zcore.initialize(
            self.model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        self.engine = engine
        self.optimizer = EngineOptimizer(engine)
        self.lr_scheduler = EngineScheduler(engine)
        self.model_wrapped = self.model
        if resume_from_checkpoint is not None:
            engine.load_checkpoint(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    # -- one micro-step -----------------------------------------------------------------
    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        engine = self.engine
        boundary = bool(self.accelerator.sync_gradients)
        if boundary != engine.is_gradient_accumulation_boundary():
            gas = engine.batch.gradient_accumulation_steps
            raise RuntimeError(
                f"the Trainer ends an accumulation cycle after micro-step {engine.micro_steps + 1} "
                f"but the engine accumulates {gas} micro-steps per step: an epoch's batch count "
                f"is not a multiple of gradient_accumulation_steps={gas}; set "
                "dataloader_drop_last=True and a dataset size that gives whole cycles per epoch"
            )
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        if boundary:
            self.lr_scheduler.record()
        # The engine divides by its accumulation steps; the loss here is already scaled for
        # them (as for DeepSpeed's scale_wrt_gas=False), so the product gives its gradient.
        engine.backward(loss * engine.batch.gradient_accumulation_steps)
        engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module) -> float | None:
        return self._get_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float | None:
        norm = self.engine.get_global_grad_norm() if self.engine is not None else None
        return None if norm is None else float(norm)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """transformers' estimate (6 x tokens x non-embedding parameters), counting each
        stage-3 parameter at its full size, not the empty tensor a rank holds between uses."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if self.engine is None or self.engine.stage != 3 or main_input not in inputs:
            return super().floating_point_ops(inputs)
        embeddings = {
            f"{name}.weight"
            for name, m in self.model.named_modules()
            if isinstance(m, nn.Embedding)
        }
        params = sum(
            torch.Size(getattr(p, "z_shape", p.shape)).numel()
            for name, p in self.model.named_parameters()
            if name not in embeddings
        )
        return 6 * inputs[main_input].numel() * params

    # -- saving and resuming ------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write ``output_dir`` as ``from_pretrained`` loads it (collective: call on every rank)."""
        from zcore.hf.save import save_pretrained

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if is_peft_model(self.model):
            save_adapter(self.model, output_dir, self.args.should_save)
        else:
            save_pretrained(self.engine if self.engine is not None else self.model, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # master weights, optimizer state, schedule and counters, sharded, in checkpoint-N
        self.engine.save_checkpoint(output_dir, tag=f"global_step{self.state.global_step}")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Nothing: ``_prepare_for_training`` loaded the engine checkpoint."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Nothing: the engine checkpoint (loaded once the engine exists) holds the weights."""

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: every rank loads its part of the engine checkpoint in
        ``state.best_model_checkpoint`` (collective; any stage, partitioned at stage 3)."""
        self.engine.load_checkpoint(self.state.best_model_checkpoint)


def _check_whole_cycles(loader: Any, args: Any, max_steps: int, world: int) -> None:
    """Refuse, before training, a run whose epoch ends in a partial accumulation cycle.

    transformers' loop ends an epoch of ``n`` micro-batches (per rank) whose ``n`` is not a
    multiple of the accumulation steps with a shorter step; the engine steps every
    ``gradient_accumulation_steps`` micro-batches (as DeepSpeed's does), so the two would part.
    """
    try:
        n = len(loader)
    except TypeError:  # an iterable dataset: the loop counts steps, not epochs
        return
    gas = int(args.gradient_accumulation_steps)
    if n % gas == 0 or max_steps < -(-n // gas):
        return
    rows = int(args.per_device_train_batch_size) * gas * world
    raise TrainerConfigError(
        f"an epoch is {n} micro-batches per rank, not a multiple of "
        f"gradient_accumulation_steps={gas}: transformers' loop would end it with a "
        f"{n % gas}-micro-batch step, which the ZeRO engine does not take; give the training "
        f"set a multiple of {rows} rows (per_device_train_batch_size x "
        f"gradient_accumulation_steps x data-parallel ranks, with dataloader_drop_last=True), or "
        f"set max_steps below {-(-n // gas)}"
    )


def _peer_failure(err: RuntimeError) -> bool:
    """Whether ``err`` is a torch.distributed failure of a multi-rank job (a peer gone)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    text = str(err)
    return isinstance(err, dist.DistError) or any(
        marker in text for marker in ("gloo", "NCCL", "Connection reset", "Connection closed")
    )


def _hidden_size(model: Any) -> int | None:
    """The model config's ``hidden_size`` (what the ``"auto"`` bucket sizes scale with)."""
    return getattr(getattr(model, "config", None), "hidden_size", None)
