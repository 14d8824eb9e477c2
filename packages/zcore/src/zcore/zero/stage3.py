"""ZeRO stage 3: parameters live as shards and are gathered only around their module's use.

Every parameter keeps its rank's slot (model dtype) and an empty ``.data``. A forward
pre-hook gathers a module's own parameters (one all-gather per module) and a forward
hook releases them; outputs are routed through an autograd node that gathers them again
when their gradient arrives, and the gradient's post-accumulate hook releases them once
backward is done with them. The order in which modules were gathered is recorded and the
next pass prefetches upcoming modules asynchronously, bounded by
``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters``. Parameters of at most
``stage3_param_persistence_threshold`` elements stay gathered. After a forward, a module's
parameters stay gathered when the recorded forward+backward order uses them again within
``stage3_max_reuse_distance`` elements of other parameters (as DeepSpeed does), as long as
``stage3_max_live_parameters`` allows; backward releases as it goes.

The gathers go through the engine's :class:`~zcore.zero.collectives.Collectives`, which
also says which comm and which piece of a parameter a gather reads and is handed every full
value gathered outside backward: ZeRO++'s qwZ quantizes the gathers, its hpZ gathers
backward from a node-local secondary copy. The defaults gather every shard over its axis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zcore.comm import Comm, Handle
from zcore.zero import linear as zero_linear
from zcore.zero.axes import param_axis
from zcore.zero.collectives import Collectives
from zcore.zero.layout import ParamShard, from_slots, own_slot

EXTERNAL = "zero_external_params"
"""The module attribute listing the parameters :func:`register_external_parameter` added."""


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """At ZeRO stage 3, gather ``parameter`` around ``module``'s forward and backward too.

    For a module that uses a parameter it does not own, or its submodules' parameters
    without calling those submodules (an MoE layer stacking its experts' weights for one
    grouped GEMM), as DeepSpeed's ``deepspeed.zero.register_external_parameter``. Call it
    before ``zcore.initialize``; it does nothing at other stages.
    """
    listed = module.__dict__.setdefault(EXTERNAL, [])
    if not any(q is parameter for q in listed):
        listed.append(parameter)


def held_bytes(parameter: nn.Parameter) -> int:
    """Bytes this rank holds for ``parameter``: its current ``.data`` (none while a ZeRO-3
    parameter is released) plus, for a partitioned parameter, its shard. Any other
    parameter: its ``.data``."""
    size = parameter.data.element_size()
    total = parameter.data.numel() * size
    owner = getattr(parameter, "_z_owner", None)
    if owner is not None and parameter in owner.params and not owner.params[parameter].persistent:
        total += owner.shard_of(parameter).numel() * size
    return total


def _external(m: nn.Module) -> list[nn.Parameter]:
    return m.__dict__.get(EXTERNAL, [])


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


@dataclass
class ShardedParam:
    """Stage-3 bookkeeping of one parameter."""

    name: str
    shard: torch.Tensor
    shape: torch.Size
    numel: int
    shard_size: int
    persistent: bool
    comm: Comm
    """The ranks this parameter is cut across (its axis, :mod:`zcore.zero.axes`)."""
    status: str = "released"  # released | inflight | gathered
    pending: _Gather | None = None

    @property
    def slots(self) -> ParamShard:
        """Where this parameter's slots lie in a rank's buffer of it alone."""
        return ParamShard(self.name, tuple(self.shape), self.numel, self.shard_size, 0)


@dataclass
class _Gather:
    handle: Handle
    out: torch.Tensor
    members: list[tuple[nn.Parameter, int, ParamShard]]
    """Each parameter, its first column in every rank's row, and how its pieces are cut."""
    world: int
    backward: bool = False
    done: bool = False


class ShardStore:
    """Where the shards of partitioned parameters live between uses.

    This one keeps each in memory (``ShardedParam.shard``); zoffload's stores keep them in
    host memory or swap files (``offload_param``) and leave ``shard`` empty for the
    parameters they hold.
    """

    def adopt(self, p: nn.Parameter, sp: ShardedParam) -> None:
        """Take a newly partitioned parameter's shard (``zero.Init`` partitions as it goes)."""

    def read(self, p: nn.Parameter, sp: ShardedParam) -> torch.Tensor:
        """This rank's shard of ``p`` (``shard_size`` elements, the parameter's dtype)."""
        return sp.shard

    def write(self, p: nn.Parameter, sp: ShardedParam, values: torch.Tensor, start: int) -> None:
        """Set elements ``[start, start + len(values))`` of ``p``'s shard."""
        sp.shard[start : start + values.numel()].copy_(values)

    def prefetch(self, params: list[nn.Parameter]) -> None:
        """A hint that ``params`` will be read soon (stores that swap start reading)."""

    def close(self) -> None:
        """Release files and buffers (the engine is being destroyed)."""


class Stage3Params:
    """Owns the shards of every partitioned parameter and gathers/releases their data."""

    def __init__(
        self,
        comm: Comm,
        persistence_threshold: int = 100_000,
        prefetch_elems: int = 50_000_000,
        max_live_elems: int = 1_000_000_000,
        max_reuse_elems: int = 0,
    ) -> None:
        self.comm = comm
        self.axis_comms: dict[str, Comm] = {"dp": comm}
        """The comm of each axis a parameter may be cut across (the engine adds ``edp``)."""
        self.persistence_threshold = persistence_threshold
        self.prefetch_elems = prefetch_elems
        self.max_live_elems = max_live_elems
        self.max_reuse_elems = max_reuse_elems
        # parameters to keep gathered after each position of the forward trace it was
        # planned on; a later forward may record another trace (a no-grad eval forward that
        # runs fewer modules), so the plan keeps its own
        self._keep_after_fwd: list[set[nn.Parameter]] = []
        self._keep_trace: list[nn.Module] = []
        self.params: dict[nn.Parameter, ShardedParam] = {}
        self.store = ShardStore()
        self.collectives = Collectives()
        """How shards are gathered (the engine sets the config's; :mod:`.collectives`)."""
        self._backward = False  # gathers now serve a backward pass (hpZ reads elsewhere)
        self.live_elems = 0
        self.peak_live_elems = 0
        self.on_repartition: list[Callable[[nn.Parameter], None]] = []
        self._fwd_trace: list[nn.Module] = []
        self._bwd_trace: list[nn.Module] = []
        self._fwd_now: list[nn.Module] = []
        self._bwd_now: list[nn.Module] = []
        self._ahead = 0  # trace index up to which the current pass has issued prefetches
        self._own_params: dict[nn.Module, list[nn.Parameter]] = {}
        self._hooks: list[Any] = []
        self._linears: list[nn.Linear] = []

    # -- partitioning -------------------------------------------------------------------
    def partition(self, p: nn.Parameter, name: str) -> None:
        """Keep only this rank's slot of ``p`` (its full value must be identical on all ranks)."""
        if p in self.params:
            return
        axis = param_axis(p)
        comm = self.axis_comms.get(axis)
        if comm is None:
            raise ValueError(
                f"parameter `{name}` is sharded over {axis}, which this stage-3 partitioner "
                f"was not given (it has {', '.join(self.axis_comms)}); build the model "
                "outside zero.Init and let zcore.initialize partition it"
            )
        numel = p.numel()
        size = -(-numel // comm.size)
        persistent = numel <= self.persistence_threshold
        sp = ShardedParam(name, torch.empty(0), p.shape, numel, size, persistent, comm)
        sp.shard = own_slot(p.data, sp.slots, comm.rank)
        self.store.adopt(p, sp)
        self.params[p] = sp
        p.z_shape = p.shape  # type: ignore[attr-defined]
        p.z_numel = numel  # type: ignore[attr-defined]
        p._z_owner = self  # type: ignore[attr-defined]
        if persistent:
            sp.status = "gathered"
        else:
            p.data = _empty(p.dtype, p.device)

    def repartition(self, p: nn.Parameter) -> None:
        """Take this rank's slot of ``p``'s current full value (after an edit) into its shard."""
        sp = self.params[p]
        self.store.write(p, sp, own_slot(p.data, sp.slots, sp.comm.rank), 0)
        self.collectives.param_gathered(p, sp.comm, p.data)
        for fn in self.on_repartition:
            fn(p)

    def cast_(self, dtype: torch.dtype) -> None:
        """Convert every shard (and persistent full value) to ``dtype``."""
        for p, sp in self.params.items():
            sp.shard = sp.shard.to(dtype)
            p.data = p.data.to(dtype) if sp.status == "gathered" else _empty(dtype, p.device)

    # -- gather / release ---------------------------------------------------------------
    def fetch(self, params: Iterable[nn.Parameter], what: str) -> None:
        """Issue one all-gather (per axis) for those of ``params`` not yet gathered or in flight."""
        todo = [p for p in params if p in self.params and self.params[p].status == "released"]
        if not todo:
            return
        # the comm and piece each gather reads: the parameter's axis and its stored shard,
        # unless the collectives say otherwise (hpZ's backward gathers)
        by_comm: dict[int, tuple[Comm, list[tuple[nn.Parameter, torch.Tensor | None]]]] = {}
        for p in todo:
            sp = self.params[p]
            source = self.collectives.gather_source(p, sp.comm, self._backward)
            comm, piece = source if source is not None else (sp.comm, None)
            by_comm.setdefault(id(comm), (comm, []))[1].append((p, piece))
        for comm, members in by_comm.values():  # parameters of two axes: one gather each
            self._gather_from(comm, members, what)

    def _gather_from(
        self, comm: Comm, todo: list[tuple[nn.Parameter, torch.Tensor | None]], what: str
    ) -> None:
        """Issue one all-gather over ``comm`` of the given pieces (None: the stored shard)."""
        w = comm.size
        pieces = [self.shard_of(p) if piece is None else piece for p, piece in todo]
        cols = sum(piece.numel() for piece in pieces)
        device = todo[0][0].device  # the shards may be offloaded; the gather runs here
        inp = torch.cat(pieces).to(device)
        out = torch.empty(w * cols, dtype=inp.dtype, device=device)
        what = f"all_gather({what}, {w * cols} elems)"
        handle = self.collectives.gather_params(comm, out, inp, what)
        members: list[tuple[nn.Parameter, int, ParamShard]] = []
        col = 0
        gather = _Gather(handle, out, members, w, self._backward)
        for (p, _), piece in zip(todo, pieces, strict=True):
            sp = self.params[p]
            members.append(
                (p, col, ParamShard(sp.name, tuple(sp.shape), sp.numel, piece.numel(), 0))
            )
            col += piece.numel()
            sp.status, sp.pending = "inflight", gather
            self.live_elems += sp.numel
        self.peak_live_elems = max(self.peak_live_elems, self.live_elems)

    def shard_of(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's current shard of ``p``, wherever the store keeps it."""
        return self.store.read(p, self.params[p])

    def write_shard(self, p: nn.Parameter, values: torch.Tensor, start: int = 0) -> None:
        """Update elements ``[start, start + len(values))`` of ``p``'s shard."""
        self.store.write(p, self.params[p], values, start)

    def _complete(self, gather: _Gather) -> None:
        if gather.done:
            return
        gather.handle.wait()
        gather.done = True
        grid = gather.out.view(gather.world, -1)
        for p, col, slots in gather.members:
            sp = self.params[p]
            if sp.status != "inflight" or sp.pending is not gather:
                continue
            p.data = from_slots(grid, col, slots).view(sp.shape)
            sp.status, sp.pending = "gathered", None
            if not gather.backward:
                self.collectives.param_gathered(p, sp.comm, p.data)

    def gather(self, params: Iterable[nn.Parameter], what: str) -> None:
        """Make the full data of ``params`` available (blocking)."""
        params = list(params)
        self.fetch(params, what)
        for p in params:
            sp = self.params.get(p)
            if sp is not None and sp.status == "inflight":
                assert sp.pending is not None
                self._complete(sp.pending)

    def release(self, params: Iterable[nn.Parameter]) -> None:
        for p in params:
            sp = self.params.get(p)
            if sp is None or sp.persistent or sp.status == "released":
                continue
            if sp.status == "inflight":
                assert sp.pending is not None
                self._complete(sp.pending)
            p.data = _empty(p.dtype, p.device)
            sp.status = "released"
            self.live_elems -= sp.numel

    def release_all(self) -> None:
        self.release(list(self.params))

    # -- hooks --------------------------------------------------------------------------
    def install(self, module: nn.Module) -> None:
        for m in module.modules():
            if any(p in self.params for p in (*m.parameters(recurse=False), *_external(m))):
                self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
                self._hooks.append(m.register_forward_hook(self._post_forward))
            sp = self.params.get(getattr(m, "weight", None))  # type: ignore[arg-type]
            if type(m) is nn.Linear and sp is not None and not sp.persistent:
                zero_linear.install(m)
                self._linears.append(m)
        self._hooks.append(module.register_forward_pre_hook(self._root_pre_forward))
        self._hooks.append(module.register_forward_hook(self._root_post_forward))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for m in self._linears:
            zero_linear.uninstall(m)
        self._linears.clear()

    def _own(self, m: nn.Module) -> list[nn.Parameter]:
        own = self._own_params.get(m)
        if own is None:
            mine = list(m.parameters(recurse=False))
            mine += [p for p in _external(m) if not any(p is q for q in mine)]
            own = self._own_params[m] = [p for p in mine if p in self.params]
        return own

    def _prefetch(self, trace: list[nn.Module], now: list[nn.Module]) -> None:
        """Fetch the modules after the current one in ``trace`` within the prefetch budget.

        ``_ahead`` remembers how far this pass has fetched, so each module is scanned once
        per pass rather than once per preceding module. The budget counts elements gathered
        ahead of use: those between the current module and ``_ahead``.
        """
        pos = len(now)
        if pos > len(trace) or trace[pos - 1] is not now[-1]:
            return
        self._ahead = max(self._ahead, pos)
        ahead = (
            sum(
                self.params[p].numel
                for m in trace[pos : self._ahead]
                for p in self._own(m)
                if self.params[p].status == "inflight"
            )
            if self._ahead > pos
            else 0
        )
        budget = self.prefetch_elems - ahead
        while self._ahead < len(trace):
            m = trace[self._ahead]
            todo = [p for p in self._own(m) if self.params[p].status == "released"]
            need = sum(self.params[p].numel for p in todo)
            if need > budget or self.live_elems + need > self.max_live_elems:
                break
            budget -= need
            self.fetch(todo, f"prefetch {type(m).__name__}")
            self._ahead += 1
        # beyond the gather window, let a swapping store start reading the next shards
        later: list[nn.Parameter] = []
        for m in trace[self._ahead : self._ahead + 4]:
            later += [p for p in self._own(m) if self.params[p].status == "released"]
        if later:
            self.store.prefetch(later)

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._fwd_now = []
        self._ahead = 0
        self._backward = False

    def _root_post_forward(self, module: nn.Module, args: Any, out: Any) -> None:
        self._fwd_trace = self._fwd_now
        self._ahead = 0  # backward starts a new pass
        if not (torch.is_grad_enabled() and module.training):
            self.release_all()

    def _pre_forward(self, m: nn.Module, args: Any) -> None:
        self._fwd_now.append(m)
        self.gather(self._own(m), f"forward {type(m).__name__}")
        if self.prefetch_elems > 0:
            self._prefetch(self._fwd_trace, self._fwd_now)

    def _post_forward(self, m: nn.Module, args: Any, out: Any) -> Any:
        own = self._own(m)
        pos = len(self._fwd_now) - 1
        plan, trace = self._keep_after_fwd, self._keep_trace
        keep = plan[pos] if pos < len(plan) and pos < len(trace) and trace[pos] is m else ()
        if keep and self.live_elems <= self.max_live_elems:
            own = [p for p in own if p not in keep]
        self.release(own)
        if torch.is_grad_enabled():
            return _wrap_outputs(out, lambda: self._pre_backward(m))
        return None

    def _pre_backward(self, m: nn.Module) -> None:
        self._backward = True
        self._bwd_now.append(m)
        self.gather(self._own(m), f"backward {type(m).__name__}")
        if self.prefetch_elems > 0:
            self._prefetch(self._bwd_trace, self._bwd_now)

    def end_backward(self) -> None:
        """After a backward pass: remember its module order and release what is still live."""
        if self._bwd_now:
            self._bwd_trace = self._bwd_now
            self._keep_trace = self._fwd_trace
            self._keep_after_fwd = self._reused_soon(self._fwd_trace + self._bwd_trace)[
                : len(self._fwd_trace)
            ]
        self._bwd_now = []
        self._ahead = 0
        self._backward = False
        self.release_all()

    def _reused_soon(self, order: list[nn.Module]) -> list[set[nn.Parameter]]:
        """For each position of ``order``: its parameters that are used again within
        ``max_reuse_elems`` elements of other gathered parameters."""
        keep: list[set[nn.Parameter]] = [set() for _ in order]
        if self.max_reuse_elems <= 0:
            return keep
        # before[k]: elements gathered by order[:k]
        before = [0]
        for m in order:
            before.append(before[-1] + sum(self.params[p].numel for p in self._own(m)))
        next_use: dict[nn.Parameter, int] = {}
        for k in range(len(order) - 1, -1, -1):
            for p in self._own(order[k]):
                j = next_use.get(p)
                if j is not None and before[j] - before[k + 1] <= self.max_reuse_elems:
                    keep[k].add(p)
                next_use[p] = k
        return keep


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.fn = fn
        ctx.mark_non_differentiable(*[t for t in tensors if not t.requires_grad])
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if ctx.fn is not None:
            ctx.fn()
            ctx.fn = None
        return (None, *grads)


def _wrap_outputs(out: Any, fn: Callable[[], None]) -> Any:
    """Route every grad-requiring tensor in ``out`` through one node that calls ``fn`` first.

    The walks are module-level functions, not nested ones: a nested function that calls
    itself is a reference cycle holding its closure (the list of outputs), which would keep
    every output alive until the garbage collector runs, including the activations that
    activation checkpointing (ALST's tiles) frees and recomputes in backward.
    """
    flat: list[torch.Tensor] = []
    _collect(out, flat)
    if not flat:
        return None
    wrapped = _PreBackward.apply(fn, *flat)
    return _rebuild(out, iter(wrapped if isinstance(wrapped, tuple) else (wrapped,)))


def _collect(x: Any, flat: list[torch.Tensor]) -> None:
    """Append the grad-requiring tensors in ``x`` (nested tuples, lists, dicts) to ``flat``."""
    if isinstance(x, torch.Tensor) and x.requires_grad:
        flat.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _collect(y, flat)
    elif isinstance(x, dict):
        for y in x.values():
            _collect(y, flat)


def _rebuild(x: Any, it: Iterator[torch.Tensor]) -> Any:
    """``x`` with its grad-requiring tensors replaced, in :func:`_collect`'s order, from ``it``."""
    if isinstance(x, torch.Tensor) and x.requires_grad:
        return next(it)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*[_rebuild(y, it) for y in x])
    if isinstance(x, (tuple, list)):
        return type(x)(_rebuild(y, it) for y in x)
    if isinstance(x, dict):
        return type(x)((k, _rebuild(v, it)) for k, v in x.items())
    return x
