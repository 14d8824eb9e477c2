"""Column- and row-parallel linears holding their local shard as a plain tensor.

``ColumnParallelLinear`` cuts the output features: rank ``r`` holds rows ``r`` of the weight
(``(out / tp, in)``) and of the bias, its input's gradient is summed over ``tp``
(:func:`~zcore.tensor.regions.copy_to`), and its output is this rank's slice of the features
(or, ``gather_output=True``, all of them). A fused projection is cut by ``blocks``: the
GPT's ``c_attn`` with ``blocks=(C, C, C)`` gives each rank the same heads of q, k and v.
``RowParallelLinear`` cuts the input features (``(out, in / tp)``), takes this rank's slice
of its input, and sums the partial outputs over ``tp``
(:func:`~zcore.tensor.regions.reduce_from`) before adding its bias, which every rank holds.

Both keep a ``tp`` :class:`~zcore.comm.Comm` and rebind it to the engine's mesh in
``bind_mesh`` (a mesh of another ``tp`` size is an error naming both).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from zcore.comm import Comm, Mesh, MeshError
from zcore.tensor.cut import TPCut, check_blocks, mark
from zcore.tensor.regions import (
    copy_to,
    gather_from,
    gather_seq,
    reduce_from,
    reduce_scatter_seq,
    scatter_to,
)


class TensorParallel(nn.Module):
    """A layer cut over the ``tp`` ranks of ``comm``."""

    comm: Comm
    sequence_parallel: bool = False
    """Whether the activations outside the cut hold ``T/tp`` positions (Megatron's sequence
    parallelism): a column cut gathers its input's positions, a row cut reduce-scatters its
    output over them."""

    def bind_mesh(self, mesh: Mesh) -> None:
        """Take the engine's ``tp`` comm (the same ranks, the engine's timeout and steps)."""
        if mesh.spec.tp != self.comm.size:
            raise MeshError(
                f"{type(self).__name__} was cut for tp {self.comm.size} but the engine's mesh "
                f"has tp {mesh.spec.tp} ({mesh.spec.formula()}); parallelize the model with "
                f"the engine's MeshSpec (tp={mesh.spec.tp}) or size the mesh tp={self.comm.size}"
            )
        self.comm = mesh.comm("tp")


def _shard_param(full: torch.Tensor, cut: TPCut, rank: int) -> nn.Parameter:
    return mark(nn.Parameter(cut.shard(full.detach(), rank), requires_grad=full.requires_grad), cut)


class ColumnParallelLinear(TensorParallel):
    """``y = x W^T + b`` with W's rows (the output features) cut over ``tp``."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        comm: Comm,
        blocks: Sequence[int],
        gather_output: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.blocks = tuple(blocks)
        self.gather_output = gather_output
        self.weight = weight
        self.bias = bias
        self.in_features = weight.shape[1]
        self.out_features = sum(self.blocks)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        comm: Comm,
        blocks: Sequence[int] | None = None,
        gather_output: bool = False,
        weight: nn.Parameter | None = None,
        name: str = "linear",
        sequence_parallel: bool = False,
    ) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (``weight``: a shard already cut the same way, for
        a weight tied to a vocabulary-parallel embedding)."""
        out = linear.out_features
        blocks = tuple(blocks) if blocks is not None else (out,)
        if sum(blocks) != out:
            raise ValueError(f"{name}: blocks {list(blocks)} do not add up to out_features {out}")
        check_blocks(name, "output features", blocks, comm.size)
        cut = TPCut(0, blocks, comm.size)
        w = weight if weight is not None else _shard_param(linear.weight, cut, comm.rank)
        b = None if linear.bias is None else _shard_param(linear.bias, cut, comm.rank)
        return cls(w, b, comm, blocks, gather_output, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enter = gather_seq if self.sequence_parallel else copy_to
        y = F.linear(enter(x, self.comm, "column-parallel input"), self.weight, self.bias)
        return gather_from(y, self.comm, "column-parallel output") if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.comm.size}, blocks={list(self.blocks)}, gather_output={self.gather_output}"
        )


class RowParallelLinear(TensorParallel):
    """``y = x W^T + b`` with W's columns (the input features) cut over ``tp``; ``b`` whole."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        comm: Comm,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = weight
        self.bias = bias
        self.out_features = weight.shape[0]
        self.in_features = weight.shape[1] * comm.size

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        comm: Comm,
        input_is_parallel: bool = True,
        name: str = "linear",
        sequence_parallel: bool = False,
    ) -> RowParallelLinear:
        """This rank's shard of ``linear``."""
        check_blocks(name, "input features", (linear.in_features,), comm.size)
        cut = TPCut(1, (linear.in_features,), comm.size)
        w = _shard_param(linear.weight, cut, comm.rank)
        return cls(w, linear.bias, comm, input_is_parallel, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to(x, self.comm, "row-parallel input")
        leave = reduce_scatter_seq if self.sequence_parallel else reduce_from
        y = leave(F.linear(x, self.weight), self.comm, "row-parallel output")
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.comm.size}, input_is_parallel={self.input_is_parallel}"
        )
