"""``save_pretrained`` for ZeRO-3: a directory transformers loads, gathered one parameter at a time.

Every rank walks the model's tensors in the same order and gathers each partitioned parameter
alone (``GatheredParameters([p])``); rank 0 streams it into ``model.safetensors`` and frees
it before the next, so no rank ever holds more than one full parameter beyond its partitions.
The safetensors header is written first: every shape is known without gathering. Rank 0
fills a temporary sibling directory (weights, ``config.json``, ``generation_config.json``, the
tokenizer files of the directory the model was loaded from), fsyncs it and renames it into
place, so a crash leaves the old directory or the new one, never a half-written one.
A tensor-parallel model (:func:`zcore.tensor.parallelize`) is saved at full size: each cut
parameter's ``tp`` shards are gathered and joined one parameter at a time too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zcore.checkpoint.files import publish_dir
from zcore.comm import Comm
from zcore.hf.keys import patterns
from zcore.hf.safetensors_io import Spec, Writer, write_order
from zcore.tensor.cut import cut_by_tp
from zcore.tensor.state import gather_full, tp_comm
from zcore.zero.init import GatheredParameters

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files of a Hugging Face tokenizer that :func:`save_pretrained` copies when present."""


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name → parameter or persistent buffer, as ``state_dict`` keys them, tied ones once."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    for mname, module in model.named_modules():
        for leaf, buf in module.named_buffers(recurse=False):
            if buf is not None and leaf not in module._non_persistent_buffers_set:
                out[f"{mname}.{leaf}" if mname else leaf] = buf
    skip = patterns(model, "_keys_to_ignore_on_save")
    return {k: v for k, v in out.items() if not any(p.search(k) for p in skip)}


def _spec(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> Spec:
    shape = list(getattr(t, "z_shape", t.shape))  # a released stage-3 parameter is empty
    cut = cut_by_tp(t)
    if cut is not None:  # this rank's tp shard: the full tensor is tp times as long on `dim`
        shape[cut.dim] *= cut.tp
    kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return Spec(name, kind, tuple(shape))


def _world_comm(model_or_engine: Any) -> Comm:
    comm = getattr(model_or_engine, "world_comm", None)
    if comm is not None:
        return comm
    if not (dist.is_available() and dist.is_initialized()):
        return Comm(None, 0, 1, 1800.0)
    return Comm(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), 1800.0)


def save_pretrained(
    model_or_engine: Any,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer_from: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``out_dir`` as transformers' ``save_pretrained`` does (``config.json``,
    ``model.safetensors``, ``generation_config.json``, tokenizer files), atomically.

    Collective: every rank calls it; rank 0 writes. Works at any ZeRO stage and on a plain
    model. The weights are the model's parameters as the forward uses them (the training
    dtype), converted to ``dtype`` if given.

    Args:
        model_or_engine: a ``ZEngine`` (its ``module`` is saved) or a transformers model.
        out_dir: the directory to write; an existing one is replaced.
        tokenizer_from: where to copy tokenizer files from (default: the directory
            :func:`~zcore.hf.from_pretrained` loaded the model from, when it has them).
        dtype: convert floating-point tensors to this dtype (default: as they are).

    Returns the absolute ``out_dir`` (on every rank).
    """
    model = getattr(model_or_engine, "module", model_or_engine)
    comm = _world_comm(model_or_engine)
    tp = tp_comm(model)
    out = Path(out_dir).absolute()
    tensors = _tensors(model)
    specs = write_order([_spec(n, t, dtype) for n, t in tensors.items()])
    tmp: Path | None = None
    failed: BaseException | None = None
    writer, f = None, None
    if comm.rank == 0:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
            f = open(tmp / "model.safetensors", "wb")
            writer = Writer(f, specs, {"format": "pt"})
        except Exception as err:
            failed = err
    for spec in specs:
        t = tensors[spec.name]
        # collective for a partitioned parameter: every rank gathers, even after a failure
        gathered = GatheredParameters([t]) if isinstance(t, nn.Parameter) else None
        with gathered if gathered is not None else contextlib.nullcontext():
            if cut_by_tp(t) is not None:  # collective over tp: every rank joins the shards
                t = gather_full(t, tp, spec.name)
            if writer is not None and failed is None:
                try:
                    writer.write(spec.name, t.detach().to(spec.dtype))
                except Exception as err:
                    failed = err
    if comm.rank == 0 and failed is None:
        try:
            assert writer is not None and f is not None and tmp is not None
            writer.close()
            f.close()
            _write_side_files(model, tmp, tokenizer_from, dtype)
            publish_dir(tmp, out)
        except Exception as err:
            failed = err
    if f is not None and not f.closed:
        f.close()
    if comm.max_flag(failed is not None, "all_reduce(save_pretrained status)"):
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if failed is not None:
            raise failed
        raise RuntimeError(f"rank 0 could not write `{out}` (its error says why)")
    return out


def _write_side_files(
    model: nn.Module,
    tmp: Path,
    tokenizer_from: str | os.PathLike[str] | None,
    dtype: torch.dtype | None,
) -> None:
    config = getattr(model, "config", None)
    if config is not None:
        config.save_pretrained(str(tmp))
        if dtype is not None:  # the config names the dtype the weights are stored in
            path = tmp / "config.json"
            data = json.loads(path.read_text())
            name = str(dtype).removeprefix("torch.")
            for key in ("dtype", "torch_dtype"):
                if key in data:
                    data[key] = name
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(tmp))
    source = tokenizer_from
    if source is None:
        source = getattr(config, "name_or_path", None) or None
    if source is not None and Path(source).is_dir():
        for name in TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, tmp / name)
