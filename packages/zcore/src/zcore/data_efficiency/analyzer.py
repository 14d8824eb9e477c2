"""The data analyzer: per-sample difficulty metrics computed once, saved as index files.

DeepSpeed's ``DataAnalyzer`` maps a data set through metric functions and writes, per
metric, ``<metric>_index_to_sample`` (samples grouped by metric value, easiest first) and
``<metric>_index_to_metric`` (the value of each group) as Megatron mmap files. Here a
metric's index is two flat ``.npy`` arrays of the same length N (the number of samples):

- ``<metric>_index_to_sample.npy``: every sample id once, in ascending metric order (ties
  by id, a stable sort), the smallest integer dtype that holds the ids;
- ``<metric>_index_to_metric.npy``: the metric of each of those ids, ascending;
- ``<metric>_sample_to_metric.npy``: the metric by sample id (for inspection).

So "the samples with metric <= v" is a prefix found by binary search
(:meth:`MetricIndex.eligible`), and "the easiest p percent" is a prefix too.

Two metrics come built in: ``seqlen`` (tokens other than padding) and ``vocab_rarity``
(the mean of ``-log p(token)`` over the sample's tokens, ``p`` the unigram frequency over
the whole data set: text made of common tokens is easier).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zcore.checkpoint.files import atomic_write

#: ``(samples (N, T) int array) -> metric (N,)``; built from the whole data set.
Metric = Callable[[np.ndarray], np.ndarray]


def seqlen(samples: np.ndarray, pad_id: int | None = None) -> np.ndarray:
    """Tokens per sample (N,) int64: ``T``, less the ``pad_id`` tokens when given."""
    n, t = samples.shape
    if pad_id is None:
        return np.full(n, t, dtype=np.int64)
    return (samples != pad_id).sum(axis=1).astype(np.int64)


def unigram_log_prob(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """``log p(token)`` (vocab_size,) float64 from counts over ``tokens`` (add-one smoothed,
    so a token never seen still has a finite rarity)."""
    counts = np.bincount(tokens.reshape(-1).astype(np.int64), minlength=vocab_size)
    return np.log((counts + 1.0) / (counts.sum() + vocab_size))


def vocab_rarity(
    samples: np.ndarray, vocab_size: int, corpus: np.ndarray | None = None
) -> np.ndarray:
    """Mean ``-log p(token)`` over each sample's tokens (N,) float64; ``p`` from ``corpus``
    (default: the samples themselves)."""
    logp = unigram_log_prob(samples if corpus is None else corpus, vocab_size)
    return -logp[samples.astype(np.int64)].mean(axis=1)


def index_paths(save_dir: str | os.PathLike[str], metric: str) -> tuple[Path, Path]:
    """``(index_to_sample, index_to_metric)`` paths of ``metric`` under ``save_dir``."""
    base = Path(save_dir)
    return base / f"{metric}_index_to_sample.npy", base / f"{metric}_index_to_metric.npy"


def _id_dtype(n: int) -> type[np.integer]:
    for dtype in (np.uint16, np.uint32):
        if n <= np.iinfo(dtype).max + 1:
            return dtype
    return np.int64


def write_index(
    values: np.ndarray, save_dir: str | os.PathLike[str], metric: str
) -> tuple[Path, Path]:
    """Save the index of per-sample ``values`` (N,) under ``save_dir`` (atomically); returns
    the ``(index_to_sample, index_to_metric)`` paths for the config."""
    values = np.asarray(values)
    if values.ndim != 1 or len(values) == 0:
        raise ValueError(f"metric {metric!r}: expected one value per sample, got {values.shape}")
    order = np.argsort(values, kind="stable").astype(_id_dtype(len(values)))
    sample_path, metric_path = index_paths(save_dir, metric)
    sample_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(sample_path, lambda f: np.save(f, order))
    atomic_write(metric_path, lambda f: np.save(f, values[order]))
    by_id = sample_path.with_name(f"{metric}_sample_to_metric.npy")
    atomic_write(by_id, lambda f: np.save(f, values))
    return sample_path, metric_path


def analyze(
    samples: np.ndarray,
    metrics: dict[str, Metric],
    save_dir: str | os.PathLike[str],
) -> dict[str, tuple[Path, Path]]:
    """Compute each metric of ``samples`` (N, T) once and write its index files; returns
    ``{metric: (index_to_sample_path, index_to_metric_path)}``."""
    out = {}
    for name, fn in metrics.items():
        values = np.asarray(fn(samples))
        if values.shape != (len(samples),):
            raise ValueError(
                f"metric {name!r} returned shape {values.shape} for {len(samples)} samples; "
                "it must return one value per sample"
            )
        out[name] = write_index(values, save_dir, name)
    return out


@dataclass(frozen=True)
class MetricIndex:
    """One metric's index: sample ids in ascending metric order, and their metrics."""

    index_to_sample: np.ndarray
    """(N,) every sample id once, easiest first."""
    index_to_metric: np.ndarray | None
    """(N,) ascending metrics of those ids; None when only percentiles are used."""

    @classmethod
    def load(
        cls, sample_path: str, metric_path: str | None, num_samples: int, where: str
    ) -> MetricIndex:
        """Read and check the index files of the metric at config path ``where`` for a
        data set of ``num_samples`` samples (ValueError naming the key and the fix)."""
        fix = (
            "delete the file to have z train analyze again, or rerun zcore.data_efficiency.analyze"
        )
        ids = _load(sample_path, f"{where}.index_to_sample_path")
        if ids.ndim != 1 or len(ids) != num_samples:
            raise ValueError(
                f"{where}.index_to_sample_path `{sample_path}` holds {len(ids)} sample ids; the "
                f"data set has {num_samples} samples (was it analyzed for another data set or "
                f"sequence length?); {fix}"
            )
        if len(np.unique(ids)) != num_samples or int(ids.max()) >= num_samples:
            raise ValueError(
                f"{where}.index_to_sample_path `{sample_path}` is not a permutation of the "
                f"{num_samples} sample ids; {fix}"
            )
        values = None
        if metric_path:
            values = _load(metric_path, f"{where}.index_to_metric_path")
            if values.shape != ids.shape or np.any(np.diff(values) < 0):
                raise ValueError(
                    f"{where}.index_to_metric_path `{metric_path}` must hold {num_samples} "
                    f"ascending values, one per id of index_to_sample_path; {fix}"
                )
        return cls(ids.astype(np.int64), values)

    def eligible(
        self, difficulty: float, difficulty_type: str, max_difficulty: float
    ) -> np.ndarray:
        """Ids admitted at ``difficulty``: metric <= it (``value``), or the easiest
        ``difficulty`` of ``max_difficulty`` parts (``percentile``, DeepSpeed's counting:
        ``N // max`` samples per part, all N at ``max``)."""
        n = len(self.index_to_sample)
        if difficulty_type == "value":
            assert self.index_to_metric is not None
            count = int(np.searchsorted(self.index_to_metric, difficulty, side="right"))
        elif difficulty >= max_difficulty:
            count = n
        else:
            count = int((n // max_difficulty) * difficulty)
        return self.index_to_sample[: max(0, min(count, n))]


def _load(path: str, key: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ValueError(
            f"{key}: `{path}` does not exist; write it with zcore.data_efficiency.analyze "
            "(z train writes it when missing)"
        ) from None
    except (OSError, ValueError) as error:
        raise ValueError(f"{key}: `{path}` is not a .npy index file ({error})") from None
