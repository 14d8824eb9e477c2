"""The curriculum sampler: each step's global batch drawn only from samples at or below
every metric's current difficulty, resumable exactly from a checkpoint.

It follows DeepSpeed's ``DeepSpeedDataSampler``: whenever a difficulty changes, the samples
it newly admits form a *cluster* (the intersection over metrics, minus earlier clusters);
a global batch picks a cluster for each of its ``B`` slots with probability proportional
to the cluster's size, takes that many ids from each cluster in the cluster's shuffled
order (reshuffling a cluster when it runs out) and shuffles the batch. So a sample is
drawn uniformly from the admitted ones, without repeats inside a pass over its cluster.

Unlike DeepSpeed, whose checkpoint stores the global numpy RNG instead of the sampler's
own generator (DeepSpeed issue #8405: a resumed run replays the stream from its seed),
the state here is the sampler's own ``torch.Generator`` state, the step, each cluster's
position and pass, and the difficulties each cluster was made at. Clusters are not
written to disk (DeepSpeed's ``data_cluster_path``): they are rebuilt from the index
files, and each pass's order comes from a generator seeded by ``(seed, cluster, pass)``.
Every rank builds the same sampler and draws the same global batch, then keeps its slice
(no broadcast).
"""

from __future__ import annotations

from typing import Any

import torch

from zcore.data_efficiency.analyzer import MetricIndex
from zcore.data_efficiency.config import DataEfficiencyConfig
from zcore.data_efficiency.schedules import CurriculumScheduler, Difficulty

_WHERE = "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics"


def load_indexes(config: DataEfficiencyConfig, num_samples: int) -> dict[str, MetricIndex]:
    """The index of every metric that selects samples (``schedule_based``), read from the
    paths in the config and checked against ``num_samples``."""
    cl = config.data_sampling.curriculum_learning
    out = {}
    for name, metric in cl.curriculum_metrics.items():
        if metric.clustering_type == "schedule_based":
            assert metric.index_to_sample_path is not None
            value_path = metric.index_to_metric_path if metric.difficulty_type == "value" else None
            out[name] = MetricIndex.load(
                metric.index_to_sample_path, value_path, num_samples, f"{_WHERE}.{name}"
            )
    return out


def _mix(*words: int) -> int:
    """One 63-bit seed from several integers (splitmix64 steps), so nearby
    ``(seed, cluster, pass)`` triples give unrelated generators."""
    state = 0
    for word in words:
        state = (state ^ (word & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15
        state &= 0xFFFFFFFFFFFFFFFF
        state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
    return state >> 1


def _pass_order(ids: torch.Tensor, seed: int, cluster: int, rounds: int) -> torch.Tensor:
    """``ids`` in the shuffled order of pass ``rounds`` over cluster ``cluster``."""
    generator = torch.Generator().manual_seed(_mix(seed, cluster, rounds))
    return ids[torch.randperm(len(ids), generator=generator)]


class CurriculumSampler:
    """Global batches of sample ids, ``next_batch()`` once per optimizer step."""

    def __init__(
        self,
        config: DataEfficiencyConfig,
        num_samples: int,
        global_batch_size: int,
        indexes: dict[str, MetricIndex] | None = None,
    ) -> None:
        cl = config.curriculum
        if cl is None:
            raise ValueError(
                "data_efficiency.data_sampling.curriculum_learning is not enabled; the sampler "
                "needs data_efficiency, data_sampling and curriculum_learning all enabled"
            )
        if num_samples < 1 or global_batch_size < 1:
            raise ValueError(f"need samples and a batch, got {num_samples}, {global_batch_size}")
        self.metrics = dict(cl.curriculum_metrics)
        self.schedulers = {n: CurriculumScheduler(m, n) for n, m in self.metrics.items()}
        self.indexes = load_indexes(config, num_samples) if indexes is None else indexes
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.total_samples = num_samples * config.data_sampling.num_epochs
        self.seed = config.seed
        self.generator = torch.Generator().manual_seed(config.seed)
        self.step = 0
        self.consumed_samples = 0
        self.difficulties: dict[str, Difficulty] = {}
        self._reset_clusters()

    def _reset_clusters(self) -> None:
        self.cluster_difficulties: list[dict[str, Difficulty]] = []
        self.clusters: list[torch.Tensor] = []
        self.positions: list[int] = []
        self.passes: list[int] = []
        self._orders: list[torch.Tensor] = []
        self._taken = torch.zeros(self.num_samples, dtype=torch.bool)

    # -- clusters -------------------------------------------------------------------------

    def admitted(self, difficulties: dict[str, Difficulty]) -> torch.Tensor:
        """Sorted ids every selecting metric admits at ``difficulties``."""
        mask = torch.ones(self.num_samples, dtype=torch.bool)
        for name, index in self.indexes.items():
            m = self.metrics[name]
            assert m.max_difficulty is not None
            mine = torch.zeros(self.num_samples, dtype=torch.bool)
            mine[index.eligible(difficulties[name], m.difficulty_type, m.max_difficulty)] = True
            mask &= mine
        return mask.nonzero().flatten()

    def _add_cluster(self, difficulties: dict[str, Difficulty]) -> None:
        ids = self.admitted(difficulties)
        new = ids[~self._taken[ids]]
        if len(new) == 0:
            return
        self._taken[new] = True
        self.cluster_difficulties.append(dict(difficulties))
        self.clusters.append(new)
        self.positions.append(0)
        self.passes.append(0)
        self._orders.append(_pass_order(new, self.seed, len(self.clusters) - 1, 0))

    def _take(self, k: int, count: int) -> list[torch.Tensor]:
        out = []
        while count > 0:
            order, pos = self._orders[k], self.positions[k]
            got = order[pos : pos + count]
            out.append(got)
            count -= len(got)
            self.positions[k] = pos + len(got)
            if self.positions[k] == len(order):  # pass over: reshuffle (DeepSpeed does too)
                self.passes[k] += 1
                self.positions[k] = 0
                self._orders[k] = _pass_order(self.clusters[k], self.seed, k, self.passes[k])
        return out

    # -- batches --------------------------------------------------------------------------

    def next_batch(self) -> torch.Tensor:
        """The next step's global batch: (global_batch_size,) int64 sample ids."""
        if self.consumed_samples + self.global_batch_size > self.total_samples:
            raise ValueError(
                f"the sampler has drawn {self.consumed_samples} of its {self.total_samples} "
                "samples (num_samples x data_efficiency.data_sampling.num_epochs); raise "
                "num_epochs"
            )
        self.step += 1
        new = {n: s.update(self.step) for n, s in self.schedulers.items()}
        if new != self.difficulties:
            self.difficulties = new
            self._add_cluster(new)
        if not self.clusters:
            raise ValueError(
                f"no sample is admitted at step {self.step} with difficulties {new}; raise "
                f"min_difficulty of {_WHERE}.<metric> (the index files hold each sample's metric)"
            )
        sizes = torch.tensor([len(c) for c in self.clusters], dtype=torch.float64)
        picks = torch.multinomial(sizes, self.global_batch_size, True, generator=self.generator)
        counts = torch.bincount(picks, minlength=len(self.clusters)).tolist()
        parts = [part for k, n in enumerate(counts) if n for part in self._take(k, n)]
        batch = torch.cat(parts).to(torch.int64)
        batch = batch[torch.randperm(len(batch), generator=self.generator)]
        self.consumed_samples += len(batch)
        return batch

    # -- checkpoint -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue the same stream."""
        return {
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "current_difficulties": dict(self.difficulties),
            "cluster_difficulties": [dict(d) for d in self.cluster_difficulties],
            "positions": list(self.positions),
            "passes": list(self.passes),
            "rng_state": self.generator.get_state(),
            "schedulers": {n: s.state_dict() for n, s in self.schedulers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`; the data set, batch and seed must be the same."""
        for key, mine in (
            ("num_samples", self.num_samples),
            ("global_batch_size", self.global_batch_size),
            ("seed", self.seed),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"the checkpoint's curriculum sampler has {key} {state[key]}, this run "
                    f"{mine}; resume with the same data, batch size and data_efficiency.seed"
                )
        if set(state["schedulers"]) != set(self.schedulers):
            raise ValueError(
                f"the checkpoint's curriculum metrics are {sorted(state['schedulers'])}, this "
                f"run's {sorted(self.schedulers)}; resume with the same curriculum_metrics"
            )
        self._reset_clusters()
        for difficulties in state["cluster_difficulties"]:
            self._add_cluster(difficulties)
        if len(self.clusters) != len(state["positions"]):
            raise ValueError(
                "the checkpoint's curriculum clusters do not match the index files; resume "
                "with the index files the run started with"
            )
        self.positions = list(state["positions"])
        self.passes = list(state["passes"])
        self._orders = [
            _pass_order(ids, self.seed, k, r)
            for k, (ids, r) in enumerate(zip(self.clusters, self.passes, strict=True))
        ]
        self.step = state["step"]
        self.consumed_samples = state["consumed_samples"]
        self.difficulties = dict(state["current_difficulties"])
        self.generator.set_state(state["rng_state"])
        for name, s in self.schedulers.items():
            s.load_state_dict(state["schedulers"][name])
