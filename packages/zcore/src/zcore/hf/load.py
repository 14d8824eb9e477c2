"""``from_pretrained`` for ZeRO-3: build a Hugging Face model with parameters on the meta
device, then read each rank's slot of every parameter straight from the safetensors files.

transformers' own ZeRO-3 path (``is_deepspeed_zero3_enabled``) imports ``deepspeed`` and calls
``deepspeed.zero.Init``/``GatheredParameters``, so there is no supported way in for another
ZeRO implementation; and zcore may not import transformers (ARCHITECTURE.md). So zcore drives
transformers only through the model class the caller passes: ``config_class.from_pretrained``
and the class's constructor (``from_config`` for an Auto class). While the model is built,
every parameter is created on the meta device (no memory; transformers' weight
initialisation on meta tensors is a no-op) and buffers are real (rotary ``inv_freq``, BERT's
``position_ids`` are computed as usual). Then each parameter is replaced by a real one holding
only what this rank keeps, read from the files with one ``pread`` per parameter, and handed to
the open ``zero.Init``'s partitioner, exactly as if ``zero.Init`` had cut it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zcore.hf.keys import KeyPlan, plan_keys
from zcore.hf.safetensors_io import Checkpoint
from zcore.zero.axes import param_axis, set_cut
from zcore.zero.init import Init


@dataclass
class LoadReport:
    """What :func:`from_pretrained` read on this rank (``model.z_load_report``)."""

    bytes_read: int = 0
    """Bytes of tensor data this rank read from the files."""
    header_bytes: int = 0
    """Bytes of safetensors headers read (every rank reads every header)."""
    checkpoint_bytes: int = 0
    """Bytes of tensor data in the checkpoint, for comparison."""
    partitioned: list[str] = field(default_factory=list)
    """Parameters of which this rank read only its slot."""
    whole: list[str] = field(default_factory=list)
    """Parameters and buffers read whole (at most the persistence threshold, or no ZeRO-3)."""
    ignored: list[str] = field(default_factory=list)
    """Checkpoint tensors not loaded (non-persistent buffers such as ``position_ids``, and
    with ``strict=False`` unexpected ones)."""
    seconds: float = 0.0


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside the block every parameter a module registers is moved to the meta device (as
    accelerate's ``init_empty_weights``); buffers stay real. Not thread-safe: it swaps
    ``nn.Module.register_parameter`` for the duration."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            attrs = dict(param.__dict__)
            meta = torch.empty_like(param, device="meta")
            param = type(param)(meta, requires_grad=param.requires_grad)
            param.__dict__.update(attrs)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _config_for(model_cls: Any, path: Path, config: Any, overrides: dict[str, Any]) -> Any:
    if config is None:
        config_class = getattr(model_cls, "config_class", None)
        if config_class is None:
            raise TypeError(
                f"{getattr(model_cls, '__name__', model_cls)} has no `config_class` (an Auto "
                "class?); pass `config=AutoConfig.from_pretrained(path)`, or a concrete class "
                "such as LlamaForCausalLM"
            )
        return config_class.from_pretrained(str(path), **overrides)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _build(model_cls: Any, config: Any, dtype: torch.dtype) -> nn.Module:
    """``model_cls`` built from ``config`` with meta parameters (transformers' ``from_config``
    for Auto classes, the constructor otherwise)."""
    with parameters_on_meta(), _default_dtype(dtype):
        if hasattr(model_cls, "config_class"):
            return model_cls(config)
        return model_cls.from_config(config, dtype=dtype)


def from_pretrained(
    model_cls: Any,
    path: str | os.PathLike[str],
    *,
    config: Any = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ds_config: Any = None,
    strict: bool = True,
    **config_overrides: Any,
) -> nn.Module:
    """Load a Hugging Face checkpoint directory into a model partitioned for ZeRO stage 3.

    Collective when partitioning: every rank calls it with the same arguments (no data is
    exchanged: each rank reads its own slots from the files). Inside an open
    :class:`zcore.zero.Init` block the model is partitioned by that block; otherwise by a
    ``zero.Init(config=ds_config)`` opened for the call (``ds_config=None``: zero.Init's
    defaults; a config below stage 3 loads every parameter whole on every rank). Pass the
    same ``ds_config`` to ``zcore.initialize``.

    Args:
        model_cls: a transformers model class (``LlamaForCausalLM``, ``BertModel``), or an
            Auto class (``AutoModelForCausalLM``) together with ``config``.
        path: a directory with ``config.json`` and ``model.safetensors`` (or an index and
            its shards), as ``save_pretrained`` writes it.
        config: the model config (default: ``model_cls.config_class.from_pretrained(path)``).
        dtype: the parameters' dtype (checkpoint values are converted).
        device: where the partitions live.
        strict: a checkpoint tensor that names nothing in the model is an error (``False``:
            ignored and listed in the report). A model parameter the checkpoint lacks is
            always an error; tied parameters (``lm_head`` ↔ ``embed_tokens``) need one name.
        config_overrides: set on the config (``hidden_dropout_prob=0.0``).

    With ``sequence_parallel_size`` above 1 in the config, the model splits each sequence
    over the mesh's ``cp`` ranks (:func:`zcore.sequence.hf.parallelize`).

    Returns the model in eval mode (as transformers does), with ``model.z_load_report`` a
    :class:`LoadReport` of what this rank read.
    """
    start = time.perf_counter()
    path = Path(path)
    ckpt = Checkpoint(path)  # fails early, naming the directory, when there are no weights
    config = _config_for(model_cls, path, config, config_overrides)
    model = None
    cp = 1
    try:
        outer = Init.active()
        with contextlib.nullcontext(outer) if outer is not None else Init(config=ds_config) as init:
            model = _build(model_cls, config, dtype)
            plan = plan_keys(model, ckpt.entries, strict)
            report = _materialize(model, plan, ckpt, init, dtype, torch.device(device))
            cp = int(getattr(init.config, "sequence_parallel_size", 1) or 1)
    finally:
        ckpt.close()
    if cp > 1:  # Ulysses over the mesh's cp axis (sequence_parallel_size)
        from zcore.comm import mesh_for_config
        from zcore.sequence.hf import parallelize

        parallelize(model, mesh_for_config(init.config))
    generation = path / "generation_config.json"
    if generation.is_file() and getattr(model, "generation_config", None) is not None:
        model.generation_config = type(model.generation_config).from_pretrained(str(path))
    with contextlib.suppress(AttributeError):
        config.name_or_path = str(path)  # where save_pretrained copies the tokenizer from
    report.header_bytes = ckpt.header_bytes
    report.checkpoint_bytes = sum(e.numel * e.dtype.itemsize for e in ckpt.entries.values())
    report.seconds = time.perf_counter() - start
    model.z_load_report = report  # type: ignore[union-attr]
    return model.eval()  # type: ignore[union-attr]


def _materialize(
    model: nn.Module,
    plan: KeyPlan,
    ckpt: Checkpoint,
    init: Init,
    dtype: torch.dtype,
    device: torch.device,
) -> LoadReport:
    """Replace every meta parameter by a real one holding this rank's slot, and fill the
    persistent buffers."""
    stage3 = init.stage3 if init.enabled else None
    report = LoadReport(ignored=list(plan.ignored))
    for names, key in plan.params:
        old = model.get_parameter(names[0])
        e = ckpt.entries[key]
        kind = dtype if old.is_floating_point() else old.dtype
        numel = e.numel
        full = torch.empty(e.shape, dtype=kind, device=device)
        comm = None
        if stage3 is not None and numel > stage3.persistence_threshold:
            # its axis's ranks (the partitioner refuses an axis zero.Init lacks)
            comm = stage3.axis_comms.get(param_axis(old), stage3.comm)
        if comm is None:  # kept whole on every rank
            full.copy_(ckpt.read(key).view(e.shape))
            report.whole.append(names[0])
        else:
            # this rank's slot only: the rest of `full` is never touched (nor resident), and
            # the partitioner copies exactly this range into the shard
            size = -(-numel // comm.size)
            lo = min(comm.rank * size, numel)
            hi = min(lo + size, numel)
            full.view(-1)[lo:hi].copy_(ckpt.read(key, lo, hi))
            report.partitioned.append(names[0])
        new = type(old)(full, requires_grad=old.requires_grad)
        new.__dict__.update(old.__dict__)
        for name in names:  # tied parameters stay one parameter
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, new)
        if stage3 is not None:
            stage3.partition(new, names[0])
            set_cut(new, init.data_axis)
    for name, key in plan.buffers:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        buf = module._buffers[leaf]
        assert buf is not None
        value = ckpt.read(key).view(ckpt.entries[key].shape)
        module._buffers[leaf] = value.to(device=device, dtype=buf.dtype).clone()
        report.whole.append(name)
    report.bytes_read = ckpt.bytes_read
    return report
