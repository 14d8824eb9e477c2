"""Read element ranges out of safetensors files, and write one tensor at a time into one.

The format is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and ``[begin, end)`` byte range in the data section, then the data (row-major,
little-endian). A flat slice of a row-major tensor is one contiguous byte range, so a ZeRO
rank reads exactly its slot of each parameter with one ``pread`` and nothing else; the
:class:`Checkpoint` counts those bytes. zcore reads and writes the format itself because its
dependencies are torch, pydantic and znative only (ARCHITECTURE.md); the tests check both
directions against the ``safetensors`` library and transformers.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100_000_000  # as the safetensors library bounds it


class CheckpointFormatError(ValueError):
    """A checkpoint directory or file cannot be read; the message names it and the fix."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Byte offset of its data within the file (header included)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: Path) -> tuple[dict[str, Entry], int]:
    """Every tensor of the file at ``path`` and the header's size in bytes."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointFormatError(f"`{path}` is {size} bytes, too short for safetensors")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointFormatError(
                f"`{path}` declares a {n}-byte header in a {size}-byte file; it is not a "
                "safetensors file or it is truncated (download or save it again)"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointFormatError(f"`{path}`: unreadable safetensors header ({err})") from err
    entries = {}
    data_start = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointFormatError(
                f"`{path}`: tensor `{name}` has dtype {info.get('dtype')!r}, which zcore does "
                f"not read (it reads {', '.join(DTYPES)})"
            )
        begin, end = info["data_offsets"]
        entry = Entry(path, dtype, tuple(info["shape"]), data_start + begin)
        if end - begin != entry.numel * dtype.itemsize or data_start + end > size:
            raise CheckpointFormatError(
                f"`{path}`: tensor `{name}` of shape {list(entry.shape)} claims bytes "
                f"[{begin}, {end}) of a {size - data_start}-byte data section; the file is "
                "damaged or truncated (download or save it again)"
            )
        entries[name] = entry
    return entries, data_start


class Checkpoint:
    """The tensors of a Hugging Face checkpoint directory: ``model.safetensors``, or the shards
    that ``model.safetensors.index.json`` lists. Counts the bytes it reads."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        single = self.directory / "model.safetensors"
        index = self.directory / "model.safetensors.index.json"
        if single.is_file():
            files = [single]
        elif index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = [self.directory / f for f in sorted(set(weight_map.values()))]
        else:
            found = (
                sorted(p.name for p in self.directory.iterdir()) if self.directory.is_dir() else []
            )
            raise CheckpointFormatError(
                f"no `model.safetensors` or `model.safetensors.index.json` in `{self.directory}` "
                f"(it holds {found or 'nothing'}); zcore loads safetensors checkpoints: pass a "
                "directory written by `save_pretrained` (transformers, or zcore.hf)"
            )
        self.entries: dict[str, Entry] = {}
        self.header_bytes = 0
        for path in files:
            if not path.is_file():
                raise CheckpointFormatError(
                    f"`{index}` lists `{path.name}`, which is missing; download it again"
                )
            entries, header = read_header(path)
            self.entries.update(entries)
            self.header_bytes += header
        self.bytes_read = 0
        """Bytes of tensor data read so far (headers are counted in ``header_bytes``)."""
        self._fds: dict[Path, int] = {}

    def read(self, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``name`` flattened (default: all), read from disk
        with one ``pread`` of exactly their bytes."""
        e = self.entries[name]
        end = e.numel if end is None else end
        size = e.dtype.itemsize
        buf = bytearray((end - start) * size)
        if buf:
            fd = self._fds.get(e.file)
            if fd is None:
                fd = self._fds[e.file] = os.open(e.file, os.O_RDONLY)
            got = os.preadv(fd, [buf], e.begin + start * size)
            if got != len(buf):
                raise CheckpointFormatError(f"`{e.file}` ended inside tensor `{name}`")
        self.bytes_read += len(buf)
        if not buf:
            return torch.empty(0, dtype=e.dtype)
        return torch.frombuffer(buf, dtype=e.dtype)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass(frozen=True)
class Spec:
    """A tensor to be written: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def write_order(specs: Sequence[Spec]) -> list[Spec]:
    """The order tensors are written in: widest dtype first (each tensor then starts at a
    multiple of its element size, as the safetensors library lays files out), else as given."""
    return sorted(specs, key=lambda s: -s.dtype.itemsize)


class Writer:
    """Streams tensors into a safetensors file: the header first (every shape is known up
    front), then each tensor's bytes as it arrives, so only one is in memory at a time."""

    def __init__(self, f: BinaryIO, specs: Sequence[Spec], metadata: dict[str, str]) -> None:
        self.f = f
        self.specs = list(specs)
        header: dict[str, object] = {"__metadata__": metadata}
        offset = 0
        for s in self.specs:
            if s.dtype not in NAMES:
                raise ValueError(f"tensor `{s.name}` has dtype {s.dtype}, which safetensors lacks")
            header[s.name] = {
                "dtype": NAMES[s.dtype],
                "shape": list(s.shape),
                "data_offsets": [offset, offset + s.nbytes],
            }
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        """The next tensor, which must be ``specs[i]`` in order, with its shape and dtype."""
        s = self.specs[self._next]
        if name != s.name or tuple(t.shape) != s.shape or t.dtype != s.dtype:
            raise ValueError(
                f"expected tensor `{s.name}` {s.dtype} {list(s.shape)} next, got `{name}` "
                f"{t.dtype} {list(t.shape)}"
            )
        if t.numel():
            data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            self.f.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.specs):
            missing = [s.name for s in self.specs[self._next :]]
            raise ValueError(f"{len(missing)} tensor(s) never written: {missing[:5]}")
