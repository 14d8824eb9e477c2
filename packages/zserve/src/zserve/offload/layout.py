"""A decoder layer's tensors as one flat byte blob, and the layer rebound onto a buffer.

Every tensor a layer holds (its norms and projection matrices; a zquant layer's codes,
scales and zero points; a Mixtral layer's router and experts) is found by walking the
layer (:func:`layer_tensors`) and given a 64-byte aligned range of the blob
(:class:`LayerLayout`). Rebinding (:meth:`LayerLayout.bind`) points each tensor *object*
at its range of a buffer with ``Tensor.set_``, so everything that holds the tensor (the
layer, a zquant module, the views taken after it) reads the buffer: a streamed layer is
bound once to its slot, and a fetch only changes the slot's bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from zserve.model.quantized_bound import BoundLinear

TENSOR_ALIGN = 64
"""Start alignment of each tensor in a blob (the kernels' vector loads)."""
BLOCK = 4096
"""O_DIRECT's alignment: a blob's size and file offset are multiples of it."""


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def layer_tensors(layer: object) -> list[torch.Tensor]:
    """Every distinct tensor reachable from ``layer`` (dataclass fields, module parameters
    and buffers, a :class:`BoundLinear`'s layer, lists), in a fixed walk order."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if id(o) not in seen:
                seen.add(id(o))
                out.append(o)
        elif isinstance(o, BoundLinear):
            walk(o.layer)
        elif isinstance(o, torch.nn.Module):
            for t in [*o.parameters(), *o.buffers()]:
                walk(t)
        elif isinstance(o, list | tuple):
            for x in o:
                walk(x)
        elif dataclasses.is_dataclass(o) or type(o).__module__.startswith("zserve."):
            for v in vars(o).values():
                walk(v)

    walk(layer)
    return out


def bound_linears(layer: object) -> list[BoundLinear]:
    """The :class:`BoundLinear` projections of ``layer`` (they hold views to retake)."""
    out: list[BoundLinear] = []

    def walk(o: Any) -> None:
        if isinstance(o, BoundLinear):
            out.append(o)
        elif isinstance(o, list | tuple):
            for x in o:
                walk(x)
        elif dataclasses.is_dataclass(o) or type(o).__module__.startswith("zserve."):
            for v in vars(o).values():
                walk(v)

    walk(layer)
    return out


@dataclass
class _Entry:
    tensor: torch.Tensor
    offset: int
    shape: torch.Size
    nbytes: int


class LayerLayout:
    """Where each tensor of one layer lies in its blob of :attr:`nbytes` bytes."""

    def __init__(self, layer: object) -> None:
        self.layer = layer
        self.entries: list[_Entry] = []
        self.bound = bound_linears(layer)
        at = 0
        for t in layer_tensors(layer):
            if t.device.type != "cpu":
                raise ValueError(
                    f"a layer tensor of shape {tuple(t.shape)} is on {t.device}; weight "
                    "offload streams CPU layers"
                )
            nbytes = t.numel() * t.element_size()
            self.entries.append(_Entry(t, at, t.shape, nbytes))
            at = round_up(at + nbytes, TENSOR_ALIGN)
        self.payload = at
        """Bytes the tensors span."""
        self.nbytes = round_up(max(at, 1), BLOCK)
        """The blob's size: whole O_DIRECT blocks."""

    def pack(self, buf: torch.Tensor) -> None:
        """Copy every tensor's bytes into ``buf`` (uint8, at least :attr:`payload` long)."""
        for e in self.entries:
            src = e.tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[e.offset : e.offset + e.nbytes].copy_(src)

    def release(self) -> None:
        """Let go of the tensors' own memory (each becomes empty until :meth:`bind`)."""
        for b in self.bound:
            b.unbind()  # its views of the old buffers
        with torch.no_grad():
            for e in self.entries:
                e.tensor.set_(torch.empty(0, dtype=e.tensor.dtype))

    def bind(self, buf: torch.Tensor) -> None:
        """Point every tensor at its range of ``buf`` (uint8, 1-D, at least :attr:`payload`
        long) and retake the projections' kernel views; the layer then computes with
        whatever bytes ``buf`` holds. ``buf`` must hold this layer's bytes now: a zquant
        projection's bind reads values from its buffers (its outlier count)."""
        storage = buf.untyped_storage()
        base = buf.storage_offset()
        with torch.no_grad():
            for e in self.entries:
                size = e.tensor.element_size()
                start = base + e.offset
                assert start % size == 0, (start, size)
                e.tensor.set_(storage, start // size, e.shape)
        self._check_bound(buf)

    def materialize(self, buf: torch.Tensor) -> None:
        """Give every tensor its own copy of its range of ``buf`` (a resident layer read
        back once), so ``buf`` can be let go."""
        with torch.no_grad():
            for e in self.entries:
                size = e.tensor.element_size()
                start = (buf.storage_offset() + e.offset) // size
                view = torch.empty(0, dtype=e.tensor.dtype).set_(
                    buf.untyped_storage(), start, e.shape
                )
                e.tensor.set_(view.clone())
        for b in self.bound:
            b.bind()

    def _check_bound(self, buf: torch.Tensor) -> None:
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
        for b in self.bound:
            b.bind()
            for a in b.kernel_call()[1]:
                if a is not None and not lo <= a.ctypes.data < hi:
                    raise ValueError(
                        f"{b!r} binds a converted copy of its weight (dtype {a.dtype}), not "
                        "the streamed bytes; serve this directory without weight offload"
                    )
