"""Loading a model's decoder layers under a weight budget.

Each layer is built, laid out as a blob (:mod:`zserve.offload.layout`) and, for ``nvme``,
written to the swap file at once and its memory let go, so loading never holds more than
one layer beyond the budget. With every size known the budget is planned
(:func:`~zserve.offload.plan.plan_layers`): the resident layers keep (``cpu``) or read back
once (``nvme``) their own memory; the streamed ones are bound to the slots of a
:class:`~zserve.offload.stream.LayerStream`.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from zserve.offload.layout import LayerLayout
from zserve.offload.plan import OffloadSpec, check_budget, plan_layers
from zserve.offload.store import DiskStore, HostStore, Store, aligned_bytes
from zserve.offload.stream import LayerStream

log = logging.getLogger(__name__)

L = TypeVar("L")


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    A layer's tensors are a few MiB each, under glibc's mmap threshold once it has risen,
    so they come from the heap, and freed ones would stay resident: loading SmolLM2 under a
    quarter budget peaked above the resident model's RSS without this."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def checkpoint_bytes(model_dir: str | Path) -> int:
    """The safetensors bytes of ``model_dir``: the swap file's size as stored."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def load_layers(
    make_layer: Callable[[int], L], num_layers: int, spec: OffloadSpec, model_dir: str | Path
) -> tuple[list[L], LayerStream | None]:
    """The ``num_layers`` layers ``make_layer(i)`` and the stream of those beyond the budget
    (None when all fit)."""
    store: Store
    if spec.kind == "nvme":
        assert spec.directory is not None
        store = DiskStore(spec.directory, checkpoint_bytes(model_dir))
    else:
        store = HostStore()
    layers: list[L] = []
    layouts: list[LayerLayout] = []
    staging = torch.empty(0, dtype=torch.uint8)
    for i in range(num_layers):
        layer = make_layer(i)
        layout = LayerLayout(layer)
        if i == 0:
            check_budget(spec.budget, layout.nbytes)  # at start, not after the whole load
        if spec.kind == "nvme":
            if staging.numel() < layout.nbytes:
                staging = aligned_bytes(layout.nbytes)
            layout.pack(staging)
            store.put(i, staging[: layout.nbytes])
            layout.release()
            trim_heap()
        layers.append(layer)
        layouts.append(layout)
    plan = plan_layers([lay.nbytes for lay in layouts], spec)
    if spec.kind == "nvme":
        for i in plan.resident:  # read back once, never again
            store.fetch(i, staging).wait()
            layouts[i].materialize(staging)
    else:
        for i in plan.streamed:
            blob = aligned_bytes(layouts[i].nbytes)
            layouts[i].pack(blob)
            store.put(i, blob)
            layouts[i].release()
    del staging
    trim_heap()
    log.info("zserve: weight offload %s: %s", spec.kind, plan.summary())
    if not plan.streamed:
        store.close()
        return layers, None
    return layers, LayerStream({i: layouts[i] for i in plan.streamed}, plan, store)
