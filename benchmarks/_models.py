"""What the serving and chat benchmarks share about their default model and text:
``default_model_dir()`` (where ``make setup`` puts SmolLM2-135M-Instruct, under
``$ZSTACK_MODELS`` when set) and ``shakespeare_prompts`` (equal-length token lists from
Hamlet). Loaded by the benchmarks with ``zcore.bench.load("_models", Path(__file__).parent)``.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_model_dir() -> Path:
    """Where ``make setup`` puts SmolLM2-135M-Instruct."""
    root = Path(os.environ.get("ZSTACK_MODELS", Path.home() / ".cache" / "zstack" / "models"))
    return root / "SmolLM2-135M-Instruct"


def shakespeare_prompts(model_dir: Path, count: int, length: int) -> list[list[int]]:
    """``count`` token lists of exactly ``length`` tokens from consecutive stretches of Hamlet."""
    from tokenizers import Tokenizer

    from ztrain.data import clean_markdown, plays_dir

    path = next(p for p in plays_dir().glob("*/*.md") if p.stem == "hamlet")
    _, text = clean_markdown(path.read_text(encoding="utf-8"), path.stem)
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    if len(ids) < count * length:
        raise ValueError(f"Hamlet has {len(ids)} tokens; {count} x {length} asked for")
    return [ids[i * length : (i + 1) * length] for i in range(count)]
