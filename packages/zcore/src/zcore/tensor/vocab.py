"""The vocabulary cut over ``tp``: an embedding and a cross-entropy that never hold all of it.

``VocabParallelEmbedding`` gives rank ``r`` the rows ``[r V/tp, (r+1) V/tp)`` of the table;
each rank looks up the ids in its range (zeros elsewhere) and the partial embeddings are
summed over ``tp``. Its weight may be shared with a column-parallel LM head (the same rows
are the same vocabulary slice), which is how a tied GPT stays tied.

:func:`vocab_parallel_cross_entropy` takes each rank's logits for its vocabulary slice
(``(N, V/tp)``) and returns the mean cross-entropy of the whole vocabulary, as
``F.cross_entropy`` would on the gathered logits, with two all-reduces over ``tp`` (the row
maximum, then the target logit and the exponent sum together) instead of gathering
``N x V`` logits; its backward needs no collective.

:class:`VocabParallelLoss` is that loss as a module a ``PipelineModule`` takes as its
``loss_fn`` (the engine hands it the mesh's ``tp`` comm), and :func:`tied_logits` the output
head that reads a (vocabulary-parallel) embedding's weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zcore.comm import Comm
from zcore.tensor.cut import TPCut, check_blocks, mark
from zcore.tensor.layers import TensorParallel
from zcore.tensor.regions import copy_to, reduce_from, reduce_scatter_seq


class VocabParallelEmbedding(TensorParallel):
    """An ``nn.Embedding`` whose rows (the vocabulary) are cut over ``tp``."""

    def __init__(self, weight: torch.nn.Parameter, comm: Comm, padding_idx: int | None = None):
        super().__init__()
        self.comm = comm
        self.weight = weight
        self.padding_idx = padding_idx
        self.num_embeddings = weight.shape[0] * comm.size
        self.embedding_dim = weight.shape[1]

    @classmethod
    def from_embedding(
        cls, emb: torch.nn.Embedding, comm: Comm, name: str = "embedding"
    ) -> VocabParallelEmbedding:
        """This rank's rows of ``emb``."""
        check_blocks(name, "vocabulary size", (emb.num_embeddings,), comm.size)
        cut = TPCut(0, (emb.num_embeddings,), comm.size)
        full = emb.weight.detach()
        w = torch.nn.Parameter(cut.shard(full, comm.rank), requires_grad=emb.weight.requires_grad)
        return cls(mark(w, cut), comm, emb.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        start = self.comm.rank * rows
        outside = (ids < start) | (ids >= start + rows)
        local = (ids - start).masked_fill(outside, 0)
        pad = self.padding_idx
        mine = pad is not None and start <= pad < start + rows
        # the padding row gets no gradient, as in nn.Embedding (on the rank that holds it)
        out = F.embedding(local, self.weight, pad - start if mine else None)  # (..., d)
        if self.comm.size > 1:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        leave = reduce_scatter_seq if self.sequence_parallel else reduce_from
        return leave(out, self.comm, "vocab-parallel embedding")

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.comm.size}"


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, comm: Comm) -> torch.Tensor:
        x = logits.float()  # (N, V/tp)
        vl = x.shape[-1]
        top = x.max(dim=-1).values  # (N,)
        comm.all_reduce(top, "all_reduce(tp max logit)", dist.ReduceOp.MAX).wait()
        x = x - top.unsqueeze(-1)
        start = comm.rank * vl
        inside = (target >= start) & (target < start + vl)
        local = (target - start).masked_fill(~inside, 0)
        picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside  # (N,)
        exp = x.exp()
        both = torch.stack([picked, exp.sum(dim=-1)])  # (2, N)
        comm.all_reduce(both, "all_reduce(tp target logit and exp sum)").wait()
        loss = both[1].log() - both[0]
        ctx.save_for_backward(exp.div_(both[1].unsqueeze(-1)), local, inside)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return (g * grad.unsqueeze(-1)).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, comm: Comm, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over the targets that are not ``ignore_index``.

    ``logits`` (N, V/tp): this rank's vocabulary slice; ``target`` (N,) ids of the whole
    vocabulary, the same on every ``tp`` rank.
    """
    if comm.size == 1:
        return F.cross_entropy(logits, target, ignore_index=ignore_index)
    keep = target != ignore_index
    per_token = _VocabParallelCE.apply(logits, target.masked_fill(~keep, 0), comm)
    return (per_token * keep).sum() / keep.sum()


class VocabParallelLoss(torch.nn.Module):
    """``loss(logits (..., V/tp), target (...))``: the mean cross-entropy over the whole
    vocabulary of logits cut over ``tp`` (:func:`vocab_parallel_cross_entropy`); with one
    ``tp`` rank, ``F.cross_entropy``. The engine binds the mesh's ``tp`` comm
    (``bind_mesh``); a ``PipelineModule`` registers its ``loss_fn`` module, so it is bound."""

    def __init__(self, ignore_index: int = -100) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.comm = Comm(None, 0, 1, 0.0)

    def bind_mesh(self, mesh: Any) -> None:
        self.comm = mesh.comm("tp")

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        flat = logits.float().reshape(-1, logits.shape[-1])  # (N, V/tp)
        return vocab_parallel_cross_entropy(flat, target.reshape(-1), self.comm, self.ignore_index)


def tied_logits(embedding: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An output head reading ``embedding``'s weight: (..., d) -> (..., V/tp) (all of ``V``
    on one rank). For a :class:`VocabParallelEmbedding` the input's gradient is summed over
    ``tp`` (the head is column-parallel over the vocabulary)."""
    comm = getattr(embedding, "comm", None)
    if isinstance(comm, Comm):
        x = copy_to(x, comm, "tied output head input")
    return F.linear(x, embedding.weight)
