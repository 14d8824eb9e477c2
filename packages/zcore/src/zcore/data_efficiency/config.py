"""DeepSpeed's data-efficiency config blocks: ``data_efficiency`` and the legacy
top-level ``curriculum_learning``, with DeepSpeed's keys, names and defaults.

Both are zcore config blocks registered lazily (:mod:`zcore.config.blocks`), so
``ZConfig.load`` checks them like any other block and ``cfg.extension("data_efficiency")``
returns the parsed model. The keys follow DeepSpeed's ``runtime/data_pipeline/constants.py``
and ``config.py``; where zstack is stricter it says so in the field's docstring:

- an enabled sub-block under a disabled parent (DeepSpeed then silently does nothing) is
  an error naming both keys;
- ``min_difficulty`` of a ``fixed_linear``/``fixed_root`` schedule must be a multiple of
  ``difficulty_step`` (DeepSpeed rounds every difficulty down to such a multiple, so the
  first steps would otherwise run *below* ``min_difficulty``, at 0 for a small one);
- random-LTD's own checks are in :mod:`zcore.data_efficiency.random_ltd_config`.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from zcore.config._base import Bool, Float, Int, ZModel, empty_block
from zcore.config.errors import MISSING, problem_at
from zcore.config.old_keys import OldKey
from zcore.data_efficiency.random_ltd_config import RandomLTDConfig

Number = Int | Float
"""A difficulty: an integer (sequence lengths, percentiles) or a number (metric values)."""
ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]
DifficultyType = Literal["value", "percentile"]
ClusteringType = Literal["schedule_based", "single_cluster"]


class ScheduleConfig(ZModel):
    """``schedule_config``: the numbers of one curriculum schedule (which ones depends on
    ``schedule_type``; keys the type does not read are accepted and ignored, as in DeepSpeed)."""

    aliases: ClassVar[dict[str, OldKey]] = {
        "total_step": OldKey(
            "total_curriculum_step",
            "runtime/data_pipeline/curriculum_scheduler.py of DeepSpeed 0.5 (fixed_root/linear)",
        )
    }

    total_curriculum_step: Int | None = Field(None, ge=1)
    """``fixed_linear``/``fixed_root``: the step at which the difficulty reaches the maximum."""
    difficulty_step: Int | None = Field(None, ge=1)
    """``fixed_linear``/``fixed_root``: every difficulty is rounded down to a multiple of this
    (8 or 16 keeps sequence lengths tensor-core friendly)."""
    root_degree: Int | None = Field(None, ge=1)
    """``fixed_root``: 2 is a square root, 3 a cube root; 1 is ``fixed_linear``."""
    difficulty: list[Number] | None = None
    """``fixed_discrete``: the difficulties in order, one more than ``max_step``."""
    max_step: list[Int] | None = None
    """``fixed_discrete``: the last step of each difficulty but the final one, increasing."""
    name: str | None = None
    """``custom`` (zstack): the name the schedule function was registered under with
    ``zcore.data_efficiency.register_curriculum_schedule``; default: the metric's name
    (DeepSpeed's ``set_custom_curriculum_learning_schedule`` keys functions by metric)."""


class ScheduleFields(ZModel):
    """A difficulty schedule: the keys a curriculum metric and the legacy block share."""

    min_difficulty: Number | None = None
    """The difficulty of the first step."""
    max_difficulty: Number | None = None
    """The difficulty the schedule ends at (for ``percentile``: the whole data set)."""
    schedule_type: ScheduleType | None = None
    """How the difficulty grows with the step."""
    schedule_config: ScheduleConfig = Field(default_factory=empty_block)
    """The schedule's numbers."""

    def check_schedule(self) -> None:
        """The keys a schedule needs, and that they fit together (ValueProblem otherwise)."""
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if getattr(self, key) is None:
                raise problem_at(key, MISSING, "is required when the curriculum is enabled")
        lo, hi = self.min_difficulty, self.max_difficulty
        assert lo is not None and hi is not None
        if hi < lo:
            raise problem_at(
                "max_difficulty", hi, f"is below min_difficulty {lo}; make max_difficulty >= {lo}"
            )
        sc, kind = self.schedule_config, self.schedule_type
        if kind in ("fixed_linear", "fixed_root"):
            needs = ["total_curriculum_step", "difficulty_step"]
            needs += ["root_degree"] if kind == "fixed_root" else []
            for key in needs:
                if getattr(sc, key) is None:
                    raise problem_at(
                        f"schedule_config.{key}", MISSING, f"is required by schedule_type {kind!r}"
                    )
            step = sc.difficulty_step
            assert step is not None
            if lo % step:
                raise problem_at(
                    "min_difficulty",
                    lo,
                    f"is not a multiple of schedule_config.difficulty_step {step}: every "
                    f"difficulty is rounded down to a multiple of it, so the first steps would "
                    f"run at {lo - lo % step}; use min_difficulty {lo - lo % step + step} or a "
                    "difficulty_step that divides it",
                )
        elif kind == "fixed_discrete":
            if not sc.difficulty or sc.max_step is None:
                raise problem_at(
                    "schedule_config",
                    sc.model_dump(exclude_none=True),
                    "fixed_discrete needs difficulty (a list) and max_step (one element fewer)",
                )
            if len(sc.difficulty) != len(sc.max_step) + 1:
                raise problem_at(
                    "schedule_config.max_step",
                    sc.max_step,
                    f"has {len(sc.max_step)} elements; fixed_discrete needs one fewer than "
                    f"difficulty ({len(sc.difficulty)}): the last difficulty holds after the "
                    "last max_step",
                )
            if any(b <= a for a, b in pairwise(sc.max_step)):
                raise problem_at("schedule_config.max_step", sc.max_step, "must increase")


class CurriculumMetricConfig(ScheduleFields):
    """One entry of ``curriculum_metrics``: a per-sample metric, its index files and the
    schedule of its difficulty."""

    index_to_sample_path: str | None = None
    """The analyzer's ``*_index_to_sample.pt``: sample ids in ascending metric order
    (required unless ``clustering_type`` is ``single_cluster``)."""
    index_to_metric_path: str | None = None
    """The analyzer's ``*_index_to_metric.pt``: the metric of each id of
    ``index_to_sample_path`` (required with ``difficulty_type: "value"``)."""
    difficulty_type: DifficultyType = "value"
    """``value``: samples whose metric <= the difficulty are drawn; ``percentile``: the
    easiest ``difficulty`` percent (``max_difficulty`` being all of them)."""
    clustering_type: ClusteringType = "schedule_based"
    """``schedule_based``: the metric selects samples; ``single_cluster``: it does not (the
    difficulty is only tracked, e.g. DeepSpeed's ``seqlen_truncate`` for the model to read)."""

    @model_validator(mode="after")
    def _complete(self) -> CurriculumMetricConfig:
        self.check_schedule()
        if self.difficulty_type == "percentile" and (self.min_difficulty or 0) < 0:
            raise problem_at("min_difficulty", self.min_difficulty, "a percentile is >= 0")
        if self.clustering_type == "schedule_based":
            if not self.index_to_sample_path:
                raise problem_at(
                    "index_to_sample_path",
                    self.index_to_sample_path or MISSING,
                    "is required with clustering_type schedule_based; write the index with "
                    "`zcore.data_efficiency.analyze` (z train writes it when missing)",
                )
            if self.difficulty_type == "value" and not self.index_to_metric_path:
                raise problem_at(
                    "index_to_metric_path",
                    self.index_to_metric_path or MISSING,
                    'is required with difficulty_type "value"; or use "percentile"',
                )
        return self


class CurriculumConfig(ZModel):
    """``data_efficiency.data_sampling.curriculum_learning``: difficulty-driven sampling."""

    enabled: Bool = False
    """Draw only samples at or below each metric's current difficulty."""
    data_cluster_path: str | None = None
    """Where DeepSpeed writes its sample clusters. Accepted and unused: zstack rebuilds the
    clusters from the index files and keeps their positions in the checkpoint."""
    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(default_factory=dict)
    """Metric name -> its index files and schedule; a sample is eligible when every
    metric admits it."""

    @model_validator(mode="after")
    def _has_metrics(self) -> CurriculumConfig:
        if self.enabled and not self.curriculum_metrics:
            raise problem_at(
                "curriculum_metrics", {}, "curriculum learning is enabled but names no metric"
            )
        return self


class DataSamplingConfig(ZModel):
    """``data_efficiency.data_sampling``."""

    enabled: Bool = False
    """Use the data-efficiency sampler."""
    num_epochs: Int = Field(1000, ge=1)
    """Passes over the data the sampler may make before it stops."""
    num_workers: Int = Field(0, ge=0)
    """DataLoader workers (DeepSpeed's key; z train reads its windows in-process)."""
    curriculum_learning: CurriculumConfig = Field(default_factory=empty_block)
    """Curriculum learning by per-sample metrics."""


class DataRoutingConfig(ZModel):
    """``data_efficiency.data_routing``."""

    enabled: Bool = False
    """Route tokens past layers (random-LTD)."""
    random_ltd: RandomLTDConfig = Field(default_factory=empty_block)
    """Random layer-token drop."""


class DataEfficiencyConfig(ZModel):
    """``data_efficiency``: DeepSpeed's Data Efficiency library (curriculum sampling and
    data routing)."""

    enabled: Bool = False
    """Turn the library on; its sub-blocks need it."""
    seed: Int = Field(1234, ge=0)
    """Seed of the sampler's own random generator."""
    data_sampling: DataSamplingConfig = Field(default_factory=empty_block)
    """Which samples are drawn."""
    data_routing: DataRoutingConfig = Field(default_factory=empty_block)
    """Which tokens each layer sees."""

    @model_validator(mode="after")
    def _parents_enabled(self) -> DataEfficiencyConfig:
        cl = self.data_sampling.curriculum_learning
        chain = [
            ("data_sampling.curriculum_learning.enabled", cl.enabled),
            ("data_sampling.enabled", self.data_sampling.enabled),
            ("enabled", self.enabled),
        ]
        for (child, on), (parent, parent_on) in pairwise(chain):
            if on and not parent_on:
                raise problem_at(
                    parent,
                    parent_on,
                    f"is false but {child} is true, which then does nothing; set both to "
                    "true, or the child to false",
                )
        if self.data_routing.random_ltd.enabled and not self.data_routing.enabled:
            raise problem_at("data_routing.enabled", False, "random_ltd needs it true")
        if self.data_routing.random_ltd.enabled and not self.enabled:
            raise problem_at("enabled", False, "data_routing.random_ltd needs it true")
        return self

    @property
    def random_ltd(self) -> RandomLTDConfig | None:
        """The random-LTD block when it is on, else None."""
        r = self.data_routing.random_ltd
        return r if r.enabled else None

    @property
    def curriculum(self) -> CurriculumConfig | None:
        """The curriculum sampling block when it is on, else None."""
        cl = self.data_sampling.curriculum_learning
        return cl if cl.enabled else None


class LegacyCurriculumConfig(ScheduleFields):
    """The top-level ``curriculum_learning`` block (DeepSpeed's legacy curriculum): a
    sequence-length warm-up. The training loop truncates each batch to the current
    difficulty (DeepSpeed's engine passes it to the model as ``curriculum_seqlen``)."""

    enabled: Bool = False
    """Run the curriculum; while false the other keys are checked but not required."""
    curriculum_type: Literal["seqlen"] = "seqlen"
    """What the difficulty is; DeepSpeed's engine acts on ``seqlen`` only."""

    @model_validator(mode="after")
    def _complete(self) -> LegacyCurriculumConfig:
        if self.enabled:
            self.check_schedule()
            if (self.min_difficulty or 0) < 1:
                raise problem_at(
                    "min_difficulty", self.min_difficulty, "a sequence length is at least 1"
                )
        return self


def parse_blocks(config: Any) -> tuple[DataEfficiencyConfig, LegacyCurriculumConfig]:
    """The two blocks of a loaded ``ZConfig`` (defaults, all off, when it gives none)."""
    de = config.extension("data_efficiency")
    legacy = config.extension("curriculum_learning")
    return (
        de if isinstance(de, DataEfficiencyConfig) else DataEfficiencyConfig(),
        legacy if isinstance(legacy, LegacyCurriculumConfig) else LegacyCurriculumConfig(),
    )
