"""The tensor-parallel compute collectives and rank 0's step commands as torch.distributed
point-to-point ops (gloo ``send``/``recv`` over loopback on CPU), for the small tensors of a
decode step.

A decode step of an ``L``-layer model runs ``2 L`` all-reduces of a few KB each; at that
size a gloo collective costs several message round trips, while a tensor-parallel layer
needs only one exchange:

* 2 ranks: one ping-pong exchange (rank 0 sends its tensor, then receives rank 1's; rank 1
  receives, then sends) and each rank adds the other's tensor;
* ``N > 2`` ranks: rank 0 receives every rank's tensor (all receives posted at once), sums
  them and sends the sum back to each (a star: two hops for every rank).

Every rank sums in rank order ``((x_0 + x_1) + x_2) + ...``, so every rank gets the same
bits (at 2 ranks they are also ``dist.all_reduce``'s: an fp addition of two terms
commutes). The gathers (:meth:`P2PCollectives.all_gather`) go the same ways: an exchange at
2 ranks, else to rank 0 and (when every rank keeps them) back.

The ops are the process group's own (``ProcessGroup.send``/``recv``, with its timeout): a
peer whose process died fails the op at once (its socket closed), a peer that stops
answering fails it at the group's timeout; never a hang. Sends are posted before the
matching receives are waited on (or, at 2 ranks, ordered opposite ways on the two ranks), so
no two ranks wait for each other's receive (gloo's send completes only once the peer's
receive is posted). Measured at 2 ranks (``benchmarks/serve_tp_collectives.py``): ~85 us an
all-reduce of one 576-float row against ``dist.all_reduce``'s ~230 us, with each rank pinned
to its own core (:func:`zserve.tp.runner.rank_cpus`); unpinned on a loaded host, gloo's
point-to-point waits show millisecond tails.

Commands (:meth:`P2PCollectives.post` / :meth:`P2PCollectives.receive`) carry rank 0's step
to the other ranks over the ``control`` group (whose timeout is the server's idle time): one
message of :data:`CMD_WORDS` int64 words ``[kind, n, payload...]``, and the payload in a
second message when it does not fit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CMD_WORDS = 2048
"""An int64 command message's words: ``[kind, n]`` and up to ``CMD_WORDS - 2`` of payload
(:mod:`zserve.tp.wire`: a decode step of 16 sequences of up to 120 KV blocks each fits)."""

_TAG = 0


class P2PCollectives:
    """Rank ``rank`` of ``size``'s collectives over the point-to-point ops of ``compute``
    (the layers' sums and gathers) and ``control`` (the step commands); see the module
    docstring. Group ranks equal global ranks here (every rank is a member of both)."""

    def __init__(
        self, rank: int, size: int, compute: dist.ProcessGroup, control: dist.ProcessGroup
    ) -> None:
        if size < 2 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of {size}: a group of >= 2 ranks is needed")
        self.rank, self.size = rank, size
        self.compute, self.control = compute, control
        self._buffers: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}

    def _scratch(self, like: torch.Tensor) -> list[torch.Tensor]:
        """``size`` flat receive buffers of ``like``'s dtype and size (kept between calls:
        a step's all-reduces repeat the same few shapes)."""
        key = (like.dtype, like.numel())
        bufs = self._buffers.get(key)
        if bufs is None:
            if len(self._buffers) > 64:
                self._buffers.clear()
            bufs = [torch.empty(like.numel(), dtype=like.dtype) for _ in range(self.size)]
            self._buffers[key] = bufs
        return bufs

    # -- the layers' collectives ---------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks in place, in rank order (the same bits on every rank).

        Raises:
            RuntimeError: a peer died, or did not answer within the group's timeout.
        """
        x = t.contiguous().view(-1)
        if self.size == 2:
            peer = self._scratch(x)[0]
            self._exchange(x, peer)
            if self.rank == 0:
                x.add_(peer)
            else:
                torch.add(peer, x, out=x)  # x_0 + x_1 on both ranks
        else:
            self._star(x, stack=None, back=True)
        if not t.is_contiguous():
            t.copy_(x.view(t.shape))

    def all_gather(self, t: torch.Tensor, *, everyone: bool = True) -> torch.Tensor | None:
        """Every rank's ``t`` (the same shape on every rank) stacked ``(size, *t.shape)`` in
        rank order, on every rank; with ``everyone=False`` (on every rank) on rank 0 only,
        None elsewhere (a gather).

        Raises:
            RuntimeError: a peer died, or did not answer within the group's timeout.
        """
        x = t.contiguous().view(-1)
        keep = everyone or self.rank == 0
        out = torch.empty((self.size, x.numel()), dtype=x.dtype) if keep else None
        if self.size > 2:
            self._star(x, stack=out, back=everyone)
        elif everyone:
            assert out is not None
            out[self.rank].copy_(x)
            self._exchange(x, out[1 - self.rank])
        elif out is not None:  # rank 0 of 2
            out[0].copy_(x)
            self._recv(self.compute, out[1], 1).wait()
        else:
            self._send(self.compute, x, 0).wait()
        return None if out is None else out.view(self.size, *t.shape)

    def _exchange(self, mine: torch.Tensor, theirs: torch.Tensor) -> None:
        """2 ranks: send ``mine`` to the peer and receive its tensor into ``theirs`` (rank 0
        sends first, rank 1 receives first: a ping-pong)."""
        g = self.compute
        if self.rank == 0:
            self._send(g, mine, 1).wait()
            self._recv(g, theirs, 1).wait()
        else:
            self._recv(g, theirs, 0).wait()
            self._send(g, mine, 0).wait()

    def _star(self, x: torch.Tensor, stack: torch.Tensor | None, back: bool) -> None:
        """``N > 2`` ranks through rank 0: with ``stack`` None on rank 0, sum ``x`` in place
        (rank order) on every rank; else gather every rank's ``x`` into rank 0's ``stack``,
        and into every rank's ``stack`` when ``back``."""
        g = self.compute
        if self.rank != 0:
            sent = self._send(g, x, 0)
            into = self._scratch(x)[0] if stack is None else stack.view(-1)
            if back:
                self._recv(g, into, 0).wait()
            sent.wait()
            if back and stack is None:
                x.copy_(into)  # the sum, once x's own send is done
            return
        parts = self._scratch(x) if stack is None else list(stack.unbind(0))
        works = [self._recv(g, parts[r], r) for r in range(1, self.size)]
        for w in works:
            w.wait()
        if stack is None:
            for r in range(1, self.size):
                x.add_(parts[r])
            reply = x
        else:
            stack[0].copy_(x)
            reply = stack.view(-1)
        if back:
            replies = [self._send(g, reply, r) for r in range(1, self.size)]
            for w in replies:
                w.wait()

    @staticmethod
    def _send(group: dist.ProcessGroup, t: torch.Tensor, dst: int) -> dist.Work:
        return group.send([t], dst, _TAG)

    @staticmethod
    def _recv(group: dist.ProcessGroup, t: torch.Tensor, src: int) -> dist.Work:
        return group.recv([t], src, _TAG)

    # -- rank 0's step commands --------------------------------------------------------------
    def post(self, kind: int, payload: torch.Tensor) -> list[dist.Work]:
        """Rank 0: command ``(kind, payload)`` (int64) to every other rank; the sends still
        in flight are returned (wait on them after the step's collectives)."""
        n = payload.numel()
        message = torch.zeros(CMD_WORDS, dtype=torch.int64)
        message[0], message[1] = kind, n
        inline = n <= CMD_WORDS - 2
        if inline and n:
            message[2 : 2 + n] = payload.view(-1)
        works = []
        for r in range(1, self.size):
            works.append(self._send(self.control, message, r))
            if not inline:
                works.append(self._send(self.control, payload.contiguous().view(-1), r))
        return works

    def receive(self) -> tuple[int, torch.Tensor]:
        """A rank other than 0: rank 0's next :meth:`post` (waits as long as the server
        idles; fails when rank 0's process is gone)."""
        message = torch.empty(CMD_WORDS, dtype=torch.int64)
        self._recv(self.control, message, 0).wait()
        kind, n = int(message[0]), int(message[1])
        if n <= CMD_WORDS - 2:
            return kind, message[2 : 2 + n].clone()
        payload = torch.empty(n, dtype=torch.int64)
        self._recv(self.control, payload, 0).wait()
        return kind, payload
