"""The parts of a `z train` run on one rank, made from its `TrainPlan`: ranks, data, engine.

`Trainer.start` builds them in the order every rank must follow (the process group, then
the data, rank 0 first so the others only read its caches, then the model and the ZeRO
engine, then the checkpoint); its methods are the loop's steps: one optimizer step, one
validation pass, one checkpoint, and the export at the end.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ztrain.train_options import TrainError, cache_dir
from ztrain.train_plan import TrainPlan

VAL_BATCHES = 4
"""Micro-batches per rank in each validation pass (the same windows every time)."""


@dataclass
class Ranks:
    """This rank and the few collectives the loop needs; no-ops on one process."""

    rank: int
    world: int

    @classmethod
    def join(cls) -> Ranks:
        """Join the launcher's process group (gloo), or stand alone without one."""
        from zcore.comm.groups import init_distributed

        if init_distributed(1800.0, backend="gloo"):
            import torch.distributed as dist

            return cls(dist.get_rank(), dist.get_world_size())
        return cls(0, 1)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def mean(self, value: float) -> float:
        return sum(self.gather(value)) / self.world

    def gather(self, *values: float) -> list[float]:
        """Every rank's `values`, rank-major, flattened (an all-gather of one small tensor)."""
        if self.world == 1:
            return list(values)
        import torch
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return torch.cat(out).tolist()

    def leave(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _threads_per_rank() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _load_data(plan: TrainPlan) -> tuple[Any, Any]:
    from ztrain.data import ShakespeareData, load_plays
    from ztrain.tokenizer import Tokenizer, train_or_load

    plays = load_plays()
    saved = plan.checkpoints / "tokenizer.json"
    if plan.resume and saved.is_file():
        tokenizer = Tokenizer.load(saved)
    else:
        tokenizer = train_or_load(cache_dir(), plan.vocab_size, plays)
    return tokenizer, ShakespeareData.load(tokenizer, cache_dir(), plays)


def _curriculum(plan: TrainPlan, ranks: Ranks, data: Any, vocab_size: int, batch: Any) -> Any:
    """The run's `CurriculumBatches` for the engine's batch sizes (`batch`, cut over the
    data-parallel ranks); rank 0 writes missing index files first."""
    from zcore.data_efficiency import Curriculum
    from ztrain.train_curriculum import CurriculumBatches, write_missing_indexes

    train = data.stream("train", plan.seq_len, plan.seed)
    config = plan.config.config
    if ranks.rank == 0:
        for line in write_missing_indexes(config, train.sample_matrix(), vocab_size):
            print(line, flush=True)
    ranks.barrier()
    try:
        curriculum = Curriculum.from_config(config, train.num_samples, batch.train_batch_size)
    except ValueError as error:
        raise TrainError(str(error)) from None
    return CurriculumBatches(curriculum, plan.seq_len, batch.train_batch_size)


@dataclass
class Trainer:
    """One rank's share of a run: what the loop works with."""

    plan: TrainPlan
    ranks: Ranks
    engine: Any
    model_config: Any
    """The `GPTConfig` or `MoELMConfig` (the preset at the tokenizer's vocabulary size)."""
    tokenizer: Any
    data: Any
    moe: Any = None
    """The `MoETally` of the MoE layers (empty for a model without)."""
    curriculum: Any = None
    """The `CurriculumBatches` of the config's curriculum (off without one)."""
    tokens_seen: int = 0
    """Training tokens of all ranks up to the current step (a curriculum shortens some)."""
    last_tokens: int = 0
    """Training tokens of all ranks in the last step."""

    @classmethod
    def start(cls, plan: TrainPlan) -> Trainer:
        """Join the job, load the data, build the engine and (resuming) load the checkpoint."""
        import torch

        from ztrain.moe_metrics import MoETally
        from ztrain.moe_plan import model_config
        from ztrain.train_parallel import build_engine

        torch.set_num_threads(_threads_per_rank())
        ranks = Ranks.join()
        if ranks.world != plan.world_size:
            raise TrainError(
                f"the run was planned for {plan.world_size} rank(s) but the job has "
                f"{ranks.world}; start it with `z train --nproc {ranks.world}`"
            )
        # Rank 0 fills the tokenizer and token caches; the others then only read them.
        if ranks.rank == 0:
            tokenizer, data = _load_data(plan)
        ranks.barrier()
        if ranks.rank != 0:
            tokenizer, data = _load_data(plan)
        config = model_config(plan.preset, tokenizer.vocab_size, plan.moe)
        rc = plan.config
        engine = build_engine(plan, config, rc.as_dict)
        model = engine.module
        curriculum = _curriculum(plan, ranks, data, tokenizer.vocab_size, engine.batch)
        if plan.resume:
            _, client_state = engine.load_checkpoint(
                str(plan.checkpoints),
                tag=plan.resume_tag,
                load_lr_scheduler_states=not rc.own_scheduler,
            )
            if rc.own_scheduler:  # the loaded param groups carry the old schedule's lr
                lrs = engine.lr_scheduler.get_last_lr()
                for group, lr in zip(engine.optimizer.param_groups, lrs, strict=True):
                    group["lr"] = lr
            curriculum.load_state_dict(client_state.get("data_efficiency"))
        moe = MoETally(model.moe_layers() if hasattr(model, "moe_layers") else [])
        seen = curriculum.tokens_before(engine.global_steps)
        return cls(plan, ranks, engine, config, tokenizer, data, moe, curriculum, seen)

    @property
    def rank0(self) -> bool:
        return self.ranks.rank == 0

    @property
    def precision(self) -> str:
        return str(self.plan.config.config.precision)

    @property
    def tokens_per_step(self) -> int:
        """Training tokens of a full-length step (all ranks)."""
        return int(self.engine.batch.train_batch_size * self.plan.seq_len)

    def evaluate(self) -> float:
        """Mean loss over the fixed validation windows, averaged over ranks (collective)."""
        import torch

        if self.plan.layout.pipelined:
            from ztrain.train_parallel import pipe_evaluate

            return pipe_evaluate(self, VAL_BATCHES)
        val, b = self.data.stream("val", self.plan.seq_len, self.plan.seed), self.engine.batch
        self.engine.eval()
        with torch.no_grad():
            total = sum(
                self.engine(
                    *val.get_micro_batch(
                        i, 0, self.engine.data_rank, b.world_size, b.micro_batch_size, 1
                    )
                )[1].item()
                for i in range(VAL_BATCHES)
            )
        self.engine.train()
        return self.ranks.mean(total / VAL_BATCHES)

    def train_step(self, step: int) -> float:
        """One optimizer step on the global batch `step`; this rank's mean micro-batch
        cross-entropy (the MoE layers' statistics go to `self.moe`)."""
        if self.plan.layout.pipelined:
            from ztrain.train_parallel import pipe_train_step

            return pipe_train_step(self, step)
        train, b = self.data.stream("train", self.plan.seq_len, self.plan.seed), self.engine.batch
        seq_len = self.curriculum.begin_step(step)
        self.last_tokens = int(b.train_batch_size * seq_len)
        self.tokens_seen += self.last_tokens
        total = 0.0
        for micro in range(b.gradient_accumulation_steps):
            # batches are cut by data rank (`b.world_size` data-parallel ranks), not the
            # global rank: ranks that mirror each other on another mesh axis read the same
            x, y = self.curriculum.micro_batch(train, step, micro, self.engine.data_rank, b)
            _, loss = self.engine(x, y)
            self.moe.add()
            self.engine.backward(loss)
            self.engine.step()
            # the cross-entropy alone (an MoE model's loss adds the aux loss)
            ce = getattr(self.engine.module, "last_ce", None)
            total += loss.item() if ce is None else ce
        return total / b.gradient_accumulation_steps

    def save(self) -> str:
        """The sharded checkpoint (collective), with model.json and tokenizer.json beside it."""
        from zcore.checkpoint.files import save_text

        ckpt = self.plan.checkpoints
        if self.rank0:
            ckpt.mkdir(parents=True, exist_ok=True)
            save_text(json.dumps(self.model_config.to_dict(), indent=2) + "\n", ckpt / "model.json")
            self.tokenizer.save(ckpt / "tokenizer.json")
        client_state = {
            "step": self.engine.global_steps,
            "preset": self.plan.preset,
            "seed": self.plan.seed,
            "seq_len": self.plan.seq_len,
            "tokenizer": str(ckpt / "tokenizer.json"),
        }
        if self.curriculum.enabled:  # the same on every rank; rank 0's copy is saved
            client_state["data_efficiency"] = self.curriculum.state_dict()
        return str(self.engine.save_checkpoint(str(ckpt), client_state=client_state))

    def export(self) -> Path:
        """Consolidate the latest checkpoint into `export/` (rank 0 only; not collective)."""
        from zcore.checkpoint import consolidate
        from ztrain.generate import export_dir
        from ztrain.gpt_pipe import as_gpt_state
        from ztrain.moe_plan import drop_non_persistent

        state = as_gpt_state(consolidate(str(self.plan.checkpoints)), self.model_config)
        state = drop_non_persistent(state, self.engine.module)
        export_dir(state, self.model_config, self.tokenizer, self.plan.export)
        return self.plan.export

    def close(self) -> None:
        """Free the engine and leave the process group."""
        self.engine.destroy()
        self.ranks.leave()
