"""The tensor-parallel compute collectives and rank 0's step commands as torch.distributed
point-to-point ops (gloo ``send``/``recv`` over loopback on CPU), for the small tensors of a
decode step.

A decode step of an ``L``-layer model runs ``2 L`` all-reduces of a few KB each; at that
size a gloo collective costs several message round trips, while a tensor-parallel layer
needs only one message each way:

* 2 ranks: each rank sends its tensor to the other and adds the other's;
* ``N > 2`` ranks: rank 0 receives every rank's tensor, sums them and sends the sum back to
  each (a star: two hops for every rank).

The all-reduces' receives are posted ahead: after each all-reduce a rank posts the receive
of its peer's next one (into a buffer of the largest message from that peer so far), so a
message finds its receive waiting. gloo then moves it at once, instead of announcing it and
waiting for the receiver's answer: one message on the critical path instead of three. Each
rank tracks the size of the receive its peer posted, so a larger sum than any before goes
as two messages (what fits, then the rest, into a receive posted for it).

Every rank sums in rank order ``((x_0 + x_1) + x_2) + ...``, so every rank gets the same
bits (at 2 ranks they are also ``dist.all_reduce``'s: an fp addition of two terms
commutes). The gathers (:meth:`P2PCollectives.all_gather`) post their receives when called:
at 2 ranks a ping-pong (rank 0 sends first, rank 1 receives first), else to rank 0 and (when
every rank keeps them) back.

The ops are the process group's own (``ProcessGroup.send``/``recv``, with its timeout,
counted from the wait): a peer whose process died fails the op at once (its socket closed),
a peer that stops answering fails it at the group's timeout; never a hang. No two ranks wait
for each other's receive: sends are posted before receives are waited on.

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
"""The gathers' messages (posted when needed)."""
_AHEAD_TAG = 1
"""The all-reduces' messages, into receives posted ahead (:meth:`P2PCollectives.all_reduce`)."""


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
        self._ahead: dict[int, dist.Work] = {}
        """Per peer: the receive posted ahead for its next all-reduce message, into
        ``self._ahead_buf[peer]``."""
        self._ahead_buf: dict[int, torch.Tensor] = {}
        """Per peer: the bytes its posted receive fills (the largest message from it so far)."""
        self._peer_ahead: dict[int, int] = {}
        """Per peer: the bytes of the receive it has posted ahead for this rank's message."""
        self._command: dist.Work | None = None
        """A rank other than 0: the receive of rank 0's next command, posted ahead
        (:meth:`expect_command`), into ``_command_buf``."""
        self._command_buf = torch.empty(CMD_WORDS, dtype=torch.int64)
        self._views: dict[tuple[int, torch.dtype, torch.Size], torch.Tensor] = {}
        """Views of the buffers in ``_ahead_buf`` by (peer, dtype, shape), kept until the
        peer's buffer is replaced."""

    # -- the layers' collectives ---------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks in place, in rank order (the same bits on every rank).

        Raises:
            RuntimeError: a peer died, or did not answer within the group's timeout.
        """
        x = t.contiguous()  # t itself where it is
        if self.size == 2:
            self._pair_reduce(x)
        else:
            self._star_reduce(x.view(-1))
        if x is not t:
            t.copy_(x)

    def _star_reduce(self, x: torch.Tensor) -> None:
        """``N > 2`` ranks: the sum of every rank's ``x`` (1-D) in place, added up on rank 0
        in rank order and sent back to each."""
        if self.rank != 0:
            sent = self._send_ahead(x, 0)
            total = self._recv_ahead(0, x)
            for w in sent:
                w.wait()
            x.copy_(total)
            self._post_ahead(0)
            return
        for r in range(1, self.size):
            x.add_(self._recv_ahead(r, x))
            self._post_ahead(r)
        sent = [w for r in range(1, self.size) for w in self._send_ahead(x, r)]
        for w in sent:
            w.wait()

    def _pair_reduce(self, x: torch.Tensor) -> None:
        """2 ranks: ``x`` (contiguous) plus the peer's, in place, ``x_0 + x_1`` on both.

        The hot path of a decode step (two calls a layer, a few KB each): its Python and
        dispatch cost counts against the exchange, so the common case (the peer's receive
        is posted at this size) sends ``x`` as it is and adds the peer's through a view
        kept from the last call of the same dtype and shape."""
        peer = 1 - self.rank
        if x.nbytes <= self._peer_ahead.get(peer, 0):
            sent = [self.compute.send([x], peer, _AHEAD_TAG)]
        else:
            sent = self._send_ahead(x.view(-1), peer)
        theirs = self._recv_ahead(peer, x)
        for w in sent:
            w.wait()  # x is read until its send is written
        if self.rank == 0:
            x.add_(theirs)
        else:
            torch.add(theirs, x, out=x)  # x_0 + x_1 on both ranks
        self._post_ahead(peer)

    # -- the all-reduces' receives, posted ahead ------------------------------------------
    def _send_ahead(self, x: torch.Tensor, peer: int) -> list[dist.Work]:
        """Send ``x`` (1-D) to ``peer``'s receive posted ahead for it; the part past that
        receive's size (a larger sum than any before from this rank) as a second message."""
        data = x.view(torch.uint8)
        size, ahead = data.numel(), self._peer_ahead.get(peer, 0)
        g = self.compute
        if size <= ahead:
            return [g.send([data], peer, _AHEAD_TAG)]
        self._peer_ahead[peer] = size  # the peer posts its next receive at this size
        works = [g.send([data[:ahead]], peer, _AHEAD_TAG)] if ahead else []
        works.append(g.send([data[ahead:]], peer, _AHEAD_TAG))
        return works

    def _recv_ahead(self, peer: int, like: torch.Tensor) -> torch.Tensor:
        """``peer``'s tensor of ``like``'s dtype and shape (:meth:`_send_ahead`'s
        message(s)), through the receive posted ahead for it where one is; valid until
        :meth:`_post_ahead` posts the next receive into it."""
        size = like.nbytes
        posted = self._ahead.pop(peer, None)
        buf = self._ahead_buf.get(peer)
        ahead = 0 if posted is None or buf is None else buf.numel()
        if posted is not None:
            posted.wait()
        if size > ahead:  # the rest came as a second message: receive it now
            got = torch.empty(size, dtype=torch.uint8)
            if ahead:
                assert buf is not None
                got[:ahead].copy_(buf)
            self.compute.recv([got[ahead:]], peer, _AHEAD_TAG).wait()
            self._ahead_buf[peer] = buf = got
            self._views = {k: v for k, v in self._views.items() if k[0] != peer}
        assert buf is not None
        key = (peer, like.dtype, like.shape)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = buf[:size].view(like.dtype).view(like.shape)
        return view

    def _post_ahead(self, peer: int) -> None:
        """Post the receive of ``peer``'s next all-reduce message (into the buffer the last
        one came in, once it has been read)."""
        self._ahead[peer] = self.compute.recv([self._ahead_buf[peer]], peer, _AHEAD_TAG)

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
        """``N > 2`` ranks through rank 0: gather every rank's ``x`` into rank 0's ``stack``,
        and into every rank's ``stack`` when ``back`` (``stack`` None where it is not)."""
        g = self.compute
        if self.rank != 0:
            sent = self._send(g, x, 0)
            if back:
                assert stack is not None
                self._recv(g, stack.view(-1), 0).wait()
            sent.wait()
            return
        assert stack is not None
        works = [self._recv(g, stack[r], r) for r in range(1, self.size)]
        for w in works:
            w.wait()
        stack[0].copy_(x)
        if back:
            replies = [self._send(g, stack.view(-1), r) for r in range(1, self.size)]
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
        idles; fails when rank 0's process is gone), through the receive
        :meth:`expect_command` posted, if it did."""
        posted, self._command = self._command, None
        message = self._command_buf
        (posted or self._recv(self.control, message, 0)).wait()
        kind, n = int(message[0]), int(message[1])
        if n <= CMD_WORDS - 2:
            return kind, message[2 : 2 + n].clone()
        payload = torch.empty(n, dtype=torch.int64)
        self._recv(self.control, payload, 0).wait()
        return kind, payload

    def expect_command(self) -> None:
        """A rank other than 0: post the receive of rank 0's next command now (call it when a
        step starts; :meth:`receive` waits on it). Rank 0's transport thread then learns of
        it while rank 0 waits in the step's collectives, so the next command goes out from
        :meth:`post` at once; unposted, it waited for that thread, which runs only when rank
        0 next blocks (its first all-reduce of the step), and the step started late."""
        if self._command is None:
            self._command = self._recv(self.control, self._command_buf, 0)
