"""Compressed all-reduce with error feedback: DeepSpeed's two-phase 1-bit scheme.

Each rank's tensor is averaged across ranks while every rank sends about ``n / 8`` bytes
instead of ``4 n``; what the 1-bit compression drops is kept in two error buffers and added
back on the next call (error feedback), so the error does not accumulate over steps.

The scheme follows DeepSpeed's ``CompressedBackend.compressed_allreduce``
(``deepspeed/runtime/comm/compressed.py``, line 57 at commit
84be831927026fcf689e9f078608bc8bef355d15; ``NcclBackend.compressed_allreduce`` in
``deepspeed/runtime/comm/nccl.py``, line 51 at the same commit, is the same math with cupy
packing). These files are not in the DeepSpeed 0.19.8 copy this repository tests against and
need CUDA (cupy, or the ``PackbitsBuilder`` op), so the tests compare with
:mod:`zcomm.reference` instead. Per rank, with the input padded with zeros to ``N`` elements
cut into ``world`` chunks of ``C = N / world``:

1. ``x = input + worker_error``; ``worker_scale = ||x|| / sqrt(N)``; ``worker_error =
   x - worker_scale * sign(x)`` (DeepSpeed: ``buffer_m.add_(worker_error)``,
   ``worker_scale = torch.linalg.norm(buffer_m) / np.sqrt(torch.numel(buffer_m))``). The
   worker scale is one per rank for the whole buffer, not one per chunk: DeepSpeed's choice,
   kept so the results stay comparable.
2. Phase 1, ``all_to_all``: chunk ``r`` of ``sign(x)`` (``C / 8`` bytes) and the worker scale
   go to rank ``r``; rank ``r`` now holds every rank's chunk ``r``.
3. ``m = sum_i sign_i * worker_scale_i * (1 / world) + server_error`` (the average of the
   decompressed chunks); ``server_scale = ||m|| / sqrt(C)``;
   ``server_error = m - server_scale * sign(m)``.
4. Phase 2, ``all_gather``: every rank's ``sign(m)`` and server scale; the output is chunk
   ``r`` = ``server_scale_r * sign_r``, cut back to the input's size and shape.

``N`` is DeepSpeed's padding (``deepspeed/runtime/fp16/onebit/adam.py``:
``corrected_tensor_size``, a multiple of ``world * divider`` with ``divider = lcm(world, 8)``):
a multiple of ``8 * world`` for ``world`` in 1, 2, 4, 8, of ``world * lcm(world, 8)`` otherwise.
The padding takes part in the scales as in DeepSpeed (the zeros count in ``N``, their sign is
``+1`` and their error is kept).

Deliberate differences from DeepSpeed:

- the scale rides in the same collective as the signs (4 bytes appended to every chunk in
  phase 1, to the chunk in phase 2), so a call is two collectives, not four; the values are
  the same fp32 bits, so the result is too;
- the output is a new tensor in the input's dtype (DeepSpeed writes into its fp32 buffer);
- an empty tensor sends nothing and has no error buffers (DeepSpeed zeroes the ones it has);
- the error buffers are checkpointed (``state_dict``) instead of reset on load; loaded on a
  different world size they start from zero, as DeepSpeed's always do.

Wire bytes per rank per call (the sizes of the buffers this rank hands to the two
collectives; :func:`wire_bytes`): phase 1 ``N / 8 + 4 * world`` (``world`` chunks of
``C / 8`` sign bytes plus a 4-byte scale each; ``1 / world`` of it is this rank's own
chunk), phase 2 ``N / (8 * world) + 4``. A plain fp32 all-reduce hands over ``4 n``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

# Packing through the dispatch (native / .cu where it applies): bit-identical to zcomm.signs.
from zcomm.kernels import pack_signs, unpack_signs
from zcomm.signs import sign_scale, signs
from zcore.comm import Comm

_SCALE_BYTES = 4  # one fp32 scale


class ErrorFeedbackReset(UserWarning):
    """Saved error buffers did not fit this job (another world size or tensor size) and
    were replaced by zeros."""


def padded_numel(n: int, world: int) -> int:
    """``n`` rounded up to DeepSpeed's multiple: ``world * lcm(world, 8)``."""
    multiple = world * math.lcm(world, 8)
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class WireBytes:
    """Bytes one rank hands to the collectives of one call."""

    phase1: int
    """all_to_all: ``world`` chunks of sign bytes, a 4-byte worker scale appended to each."""
    phase2: int
    """all_gather: this rank's server sign bytes and its 4-byte server scale."""

    @property
    def total(self) -> int:
        return self.phase1 + self.phase2


def wire_bytes(n: int, world: int) -> WireBytes:
    """What one rank sends to all-reduce ``n`` elements over ``world`` ranks
    (``N = padded_numel(n, world)``): ``N/8 + 4 world`` then ``N/(8 world) + 4``."""
    if n == 0:
        return WireBytes(0, 0)
    chunk_bytes = padded_numel(n, world) // world // 8
    return WireBytes(world * (chunk_bytes + _SCALE_BYTES), chunk_bytes + _SCALE_BYTES)


@dataclass
class ErrorFeedback:
    """The two error buffers of one reduced tensor on one rank (fp32, on its device)."""

    numel: int
    """The unpadded size of the tensor they belong to."""
    worker: torch.Tensor
    """(N,): what this rank's compression dropped."""
    server: torch.Tensor
    """(N / world,): what the compression of this rank's averaged chunk dropped."""


def _scale_as_bytes(scale: torch.Tensor) -> torch.Tensor:
    """(4,) uint8: the fp32 bits of a 0-d scale."""
    return scale.to(torch.float32).reshape(1).view(torch.uint8)


def _bytes_as_scales(raw_W4: torch.Tensor) -> torch.Tensor:
    """(W, 1) fp32 scales from (W, 4) uint8 rows."""
    aligned_W4 = torch.empty(raw_W4.shape, dtype=torch.uint8, device=raw_W4.device)  # offset 0
    return aligned_W4.copy_(raw_W4).view(torch.float32)


class CompressedAllReduce:
    """Averages tensors across the ranks of ``comm`` with 1-bit compression and error feedback.

    One object serves any number of tensors: each is named by ``key`` and keeps its own
    error buffers (made at zero on first use). Every rank must call it with the same keys,
    sizes and order. Runs over any backend with ``all_to_all_single`` and
    ``all_gather_into_tensor`` (gloo, NCCL).
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.errors: dict[str, ErrorFeedback] = {}
        self.last_bytes = WireBytes(0, 0)
        """What this rank sent in the most recent call."""
        self.bytes_sent = 0
        """What this rank has sent over every call so far."""

    @property
    def world(self) -> int:
        return self.comm.size

    def _errors_for(self, key: str, n: int, device: torch.device) -> ErrorFeedback:
        padded = padded_numel(n, self.world)
        ef = self.errors.get(key)
        if ef is None:
            zeros = torch.zeros(padded, dtype=torch.float32, device=device)
            ef = ErrorFeedback(n, zeros, zeros.new_zeros(padded // self.world))
            self.errors[key] = ef
        elif ef.numel != n:
            raise ValueError(
                f"compressed all-reduce `{key}`: got {n} elements, but its error buffers "
                f"were made for {ef.numel}; use one key per tensor"
            )
        elif ef.worker.device != device:  # loaded from a checkpoint on another device
            ef.worker, ef.server = ef.worker.to(device), ef.server.to(device)
        return ef

    def __call__(self, tensor: torch.Tensor, key: str = "default") -> torch.Tensor:
        """The average of ``tensor`` over the ranks, 1-bit compressed: a new tensor of its
        shape and dtype. Updates ``key``'s error buffers."""
        n = tensor.numel()
        if n == 0:
            self.last_bytes = WireBytes(0, 0)
            return tensor.clone()
        world = self.world
        ef = self._errors_for(key, n, tensor.device)
        padded = ef.worker.numel()
        chunk = padded // world
        chunk_bytes = chunk // 8

        # Worker side: compensate, compress, keep what compression dropped.
        x_N = torch.zeros(padded, dtype=torch.float32, device=tensor.device)
        x_N[:n] = tensor.reshape(-1)
        x_N.add_(ef.worker)
        worker_scale = sign_scale(x_N)
        ef.worker = x_N - worker_scale * signs(x_N)

        # Phase 1: row r (chunk r's signs + this rank's scale) goes to rank r.
        send_WB = torch.empty(
            world, chunk_bytes + _SCALE_BYTES, dtype=torch.uint8, device=x_N.device
        )
        send_WB[:, :chunk_bytes] = pack_signs(x_N).view(world, chunk_bytes)
        send_WB[:, chunk_bytes:] = _scale_as_bytes(worker_scale)
        recv_WB = torch.empty_like(send_WB)
        self.comm.all_to_all_single(
            recv_WB, send_WB, None, None, f"compressed all-reduce `{key}` signs"
        ).wait()

        # Server side: average this rank's chunk from every rank, compensate, compress again.
        signs_WC = unpack_signs(recv_WB[:, :chunk_bytes].reshape(-1), world * chunk).view(
            world, chunk
        )
        scales_W1 = _bytes_as_scales(recv_WB[:, chunk_bytes:])
        server_C = signs_WC.mul_(scales_W1.mul(1 / world)).sum(0)
        server_C.add_(ef.server)
        server_scale = sign_scale(server_C)
        ef.server = server_C - server_scale * signs(server_C)

        # Phase 2: every rank's compressed chunk to every rank.
        mine_B = torch.cat([pack_signs(server_C), _scale_as_bytes(server_scale)])
        all_WB = torch.empty(world, mine_B.numel(), dtype=torch.uint8, device=x_N.device)
        self.comm.all_gather(
            all_WB.view(-1), mine_B, f"compressed all-reduce `{key}` result"
        ).wait()

        out_WC = unpack_signs(all_WB[:, :chunk_bytes].reshape(-1), padded).view(world, chunk)
        out_WC.mul_(_bytes_as_scales(all_WB[:, chunk_bytes:]))
        self.last_bytes = WireBytes(send_WB.numel(), mine_B.numel())
        self.bytes_sent += self.last_bytes.total
        return out_WC.view(-1)[:n].view(tensor.shape).to(tensor.dtype)

    def reset(self) -> None:
        """Forget every error buffer (the next call of each key starts from zero)."""
        self.errors.clear()

    def state_dict(self) -> dict[str, Any]:
        """This rank's error buffers (copies) and the world size they were made for."""
        return {
            "world": self.world,
            "errors": {
                key: {"numel": ef.numel, "worker": ef.worker.clone(), "server": ef.server.clone()}
                for key, ef in self.errors.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s buffers. Saved at another world size (or with
        buffers of another size) they cannot be re-cut, since each rank's error is its own:
        every buffer starts from zero instead, with an :class:`ErrorFeedbackReset` warning."""
        self.errors.clear()
        saved = state["errors"]
        for key, entry in saved.items():
            padded = padded_numel(entry["numel"], self.world)
            worker, server = entry["worker"], entry["server"]
            if (
                state["world"] != self.world
                or worker.numel() != padded
                or server.numel() != padded // self.world
            ):
                warnings.warn(
                    f"compressed all-reduce error buffers were saved at world {state['world']} "
                    f"(`{key}`: worker {worker.numel()}, server {server.numel()} elements) and "
                    f"this job has world {self.world} (worker {padded}, server "
                    f"{padded // self.world}); every error buffer starts from zero",
                    ErrorFeedbackReset,
                    stacklevel=2,
                )
                self.errors.clear()
                return
            self.errors[key] = ErrorFeedback(
                entry["numel"], worker.to(torch.float32).clone(), server.to(torch.float32).clone()
            )
