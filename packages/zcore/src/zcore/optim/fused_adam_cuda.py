"""Adam/AdamW for CUDA fp32 parameters: one multi-tensor kernel launch per step.

The kernel (``znative/cuda/kernels/fused_adam.cu``) reads a table of device
pointers and sizes plus a chunk table, so one launch covers every tensor of a
param group. Tables are built here as int64 CUDA tensors, handed to
:func:`znative.cuda.launch` by DLPack, and run on torch's current stream, so the
step is ordered with the backward pass that produced the gradients. CuPy is
imported on first use, never by importing this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

import znative.cuda
from zcore.optim._base import ParamsT, TorchStateCompat, check_adam_group

#: elements per chunk, one chunk per thread block; a multiple of 4 keeps chunks float4-aligned
CHUNK_SIZE = 1 << 15
_BLOCK = 512  # matches __launch_bounds__(512) in the kernel
_KERNELS = {torch.float32: "fused_adam_f32", torch.bfloat16: "fused_adam_bf16_grad"}
_TABLE_CACHE_SIZE = 16


def _hyperparameters(
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
) -> tuple[Any, ...]:
    """The kernel's scalar arguments, derived in double precision as torch derives them."""
    lr, beta1, beta2, eps, weight_decay = map(float, (lr, *betas, eps, weight_decay))
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    f32, i32 = znative.cuda.f32, znative.cuda.i32
    return (
        f32(1 - beta1),
        f32(beta2),
        f32(1 - beta2),
        f32(eps),
        f32(weight_decay),
        f32(1 - lr * weight_decay),
        f32(-(lr / bias_correction1)),
        f32(bias_correction2**0.5),
        i32(decoupled),
        i32(maximize),
    )


def _host_table(rows: Sequence[tuple[int, ...]], chunk_size: int) -> torch.Tensor:
    """One int64 CPU tensor ``[ptrs (T, 4) | sizes (T,) | chunks (C, 2)]``, the kernel's layout.

    ``rows`` holds ``(param, grad, exp_avg, exp_avg_sq addresses, numel)`` per tensor.
    """
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)  # (T, 5)
    sizes = table[:, 4]
    counts = (sizes + chunk_size - 1) // chunk_size  # chunks per tensor, (T,)
    owner = torch.repeat_interleave(torch.arange(len(rows)), counts)  # (C,)
    first_chunk = torch.cumsum(counts, 0) - counts  # (T,)
    starts = (torch.arange(owner.numel()) - first_chunk[owner]) * chunk_size  # (C,)
    chunks = torch.stack([owner, starts], dim=1)  # (C, 2)
    return torch.cat([table[:, :4].flatten(), sizes, chunks.flatten()])


def _check_like(
    t: torch.Tensor,
    p: torch.Tensor,
    name: str,
    dtypes: tuple[torch.dtype, ...],
    *,
    dense: bool = True,
) -> None:
    """Raise unless ``t`` can be read (``dense=False``) or updated alongside parameter ``p``."""
    if t.is_sparse:
        raise TypeError(f"{name} is sparse; FusedAdamCUDA takes dense gradients")
    if t.device != p.device:
        raise TypeError(f"{name} is on {t.device} but its parameter is on {p.device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} dtype is {t.dtype}; expected one of {', '.join(map(str, dtypes))}")
    if t.shape != p.shape:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)} but its parameter has {tuple(p.shape)}"
        )
    if dense and not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; the step updates memory in place")


def _check_param(p: Any, where: str) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where} is a {type(p).__name__}, not a tensor")
    if p.device.type != "cuda":
        raise TypeError(
            f"{where} is on device {p.device}; FusedAdamCUDA updates fp32 parameters on a CUDA "
            "device (use zcore.optim.CPUAdam for parameters on the CPU)"
        )
    if p.dtype != torch.float32:
        raise TypeError(f"{where} dtype is {p.dtype}; FusedAdamCUDA updates fp32 parameters")
    if not p.is_contiguous():
        raise ValueError(
            f"{where} with shape {tuple(p.shape)} and strides {p.stride()} is not contiguous; "
            "the step updates memory in place"
        )


def fused_adam_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
    maximize: bool = False,
    chunk_size: int = CHUNK_SIZE,
    _table_cache: dict[tuple[Any, ...], torch.Tensor] | None = None,
    _checked: bool = False,
) -> None:
    """Adam/AdamW step ``step`` (1-based, shared by all tensors) on fp32 CUDA tensors, in place.

    ``grads`` are all float32 or all bfloat16 (e.g. bf16 model gradients against
    fp32 master weights) and need not be contiguous; everything else must be.
    All tensors are checked before the kernel is launched on the current stream
    of their device.
    """
    n = len(params)
    if not len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n:
        raise ValueError(
            f"got {n} params, {len(grads)} grads, {len(exp_avgs)} exp_avgs and "
            f"{len(exp_avg_sqs)} exp_avg_sqs; need one of each per parameter"
        )
    if step < 1:
        raise ValueError(f"step is {step}; steps count from 1")
    if chunk_size < 4 or chunk_size % 4:
        raise ValueError(f"chunk_size is {chunk_size}; expected a positive multiple of 4")
    if n == 0:
        return
    device = params[0].device
    grad_dtype = grads[0].dtype
    rows = []
    keep_alive = []  # contiguous copies of strided grads, live until the launch is queued
    for i in range(n):
        p = params[i]
        g = grads[i]
        if not _checked:  # FusedAdamCUDA.step checks everything once before its launches
            _check_param(p, f"params[{i}]")
            if p.device != device:
                raise TypeError(f"params[{i}] is on {p.device} but params[0] is on {device}")
            dtypes = (grad_dtype,) if i else tuple(_KERNELS)
            _check_like(g, p, f"grads[{i}]", dtypes, dense=False)
            _check_like(exp_avgs[i], p, f"exp_avgs[{i}]", (torch.float32,))
            _check_like(exp_avg_sqs[i], p, f"exp_avg_sqs[{i}]", (torch.float32,))
        if p.numel() == 0:
            continue
        g = g.contiguous()  # the kernel only reads grads: a copy of a strided one will do
        keep_alive.append(g)
        m, v = exp_avgs[i], exp_avg_sqs[i]
        rows.append((p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel()))
    if not rows:
        return

    key = (device, chunk_size, tuple(rows))
    table = _table_cache.get(key) if _table_cache is not None else None
    if table is None:
        # Pinned + non_blocking: the copy is queued on the current stream without a host sync.
        table = _host_table(rows, chunk_size).pin_memory().to(device, non_blocking=True)
        if _table_cache is not None:
            if len(_table_cache) >= _TABLE_CACHE_SIZE:
                del _table_cache[next(iter(_table_cache))]
            _table_cache[key] = table
    t = len(rows)
    n_chunks = (table.numel() - 5 * t) // 2
    znative.cuda.launch(
        "fused_adam",
        _KERNELS[grad_dtype],
        n_chunks,
        _BLOCK,
        (
            table[: 4 * t],
            table[4 * t : 5 * t],
            table[5 * t :],
            znative.cuda.i64(chunk_size),
            *_hyperparameters(step, lr, betas, eps, weight_decay, decoupled_weight_decay, maximize),
        ),
        stream=torch.cuda.current_stream(device).cuda_stream,
        device=device.index,
    )


class FusedAdamCUDA(TorchStateCompat):
    """``torch.optim.Adam`` for fp32 CUDA parameters, one fused kernel launch per param group.

    Same arguments, defaults and ``state_dict()`` content as ``torch.optim.Adam``
    (``decoupled_weight_decay=True`` gives AdamW), so checkpoints move both ways
    between this and ``torch.optim.Adam``/``AdamW``. Needs CuPy
    (``pip install znative[cuda12]`` or ``[cuda13]``).

    Args:
        chunk_size: elements each thread block updates; a positive multiple of 4.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
        chunk_size: int = CHUNK_SIZE,
    ):
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by FusedAdamCUDA; use torch.optim.Adam")
        if chunk_size < 4 or chunk_size % 4:
            raise ValueError(f"chunk_size is {chunk_size}; expected a positive multiple of 4")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        check_adam_group(defaults, "defaults", "FusedAdamCUDA")
        self.chunk_size = chunk_size
        self._table_cache: dict[tuple[Any, ...], torch.Tensor] = {}
        # param -> (exp_avg, exp_avg_sq) as last checked by name; group -> (step views, buffer)
        self._verified: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self._steps: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}
        super().__init__(params, defaults)
        ok, reason = znative.cuda.cupy_status()
        if not ok:
            raise znative.cuda.CudaUnavailableError(f"FusedAdamCUDA needs CuPy: {reason}")

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled (``torch.optim.Optimizer`` pickles only defaults, state and groups):
        the caches start empty and ``chunk_size`` at its default unless it was set."""
        super().__setstate__(state)
        self.__dict__.setdefault("chunk_size", CHUNK_SIZE)
        self._table_cache = {}
        self._verified = {}
        self._steps = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        check_adam_group(group, f"param_groups[{gi}]", "FusedAdamCUDA")
        for pi, p in enumerate(group["params"]):
            _check_param(p, f"param_groups[{gi}].params[{pi}]")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by this optimizer or by ``torch.optim.Adam``/``AdamW``."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].contiguous()
            # torch keeps `step` on the device for fused/capturable runs; ours lives on the CPU.
            if "step" in state:
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        self._table_cache.clear()
        self._verified.clear()
        self._steps.clear()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter that has a gradient; all checks run before the first launch.

        The host work per tensor is kept to attribute reads, so the GPU does not wait on
        the host between steps (``z bench adam-cuda`` times both). A parameter's state
        tensors are checked by name once and then recognised by identity; its gradient and
        the parameter itself are checked every step by the quick test, and by name when
        that fails. The step counters of a group's parameters are 0-d views of one CPU
        buffer (``state["step"]`` stays a float32 tensor per parameter, as in
        ``torch.optim.Adam``), read and advanced with one op each.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = []
        for gi, group in enumerate(self.param_groups):
            check_adam_group(group, f"param_groups[{gi}]", "FusedAdamCUDA")
            ps, gs, ms, vs, states = [], [], [], [], []
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if not state:
                    _check_param(p, f"param_groups[{gi}].params[{pi}]")
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                known = self._verified.get(p)
                if (
                    known is None
                    or known[0] is not m
                    or known[1] is not v
                    or not _quick_ok(p, g, m)
                ):
                    _check_all(p, state, f"param_groups[{gi}].params[{pi}]")
                    self._verified[p] = (m, v)
                ps.append(p)
                gs.append(g)
                ms.append(m)
                vs.append(v)
                states.append(state)
            if ps:
                todo.append((gi, ps, gs, ms, vs, self._step_buffer(gi, states)))
        for gi, ps, gs, ms, vs, buf in todo:
            group = self.param_groups[gi]
            steps = (buf + 1).tolist()
            # One launch per step count: tensors whose steps differ (a parameter that
            # skipped steps without a gradient) need their own bias correction.
            by_step: dict[int, list[int]] = {}
            for i, st in enumerate(steps):
                by_step.setdefault(int(st), []).append(i)
            for step, idx in by_step.items():
                whole = len(idx) == len(ps)
                fused_adam_step_(
                    ps if whole else [ps[i] for i in idx],
                    gs if whole else [gs[i] for i in idx],
                    ms if whole else [ms[i] for i in idx],
                    vs if whole else [vs[i] for i in idx],
                    step=step,
                    lr=group["lr"],
                    betas=group["betas"],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
                    maximize=bool(group["maximize"]),
                    chunk_size=self.chunk_size,
                    _table_cache=self._table_cache,
                    _checked=True,
                )
        for *_, buf in todo:
            buf.add_(1)
        return loss

    def _step_buffer(self, gi: int, states: list[dict[str, Any]]) -> torch.Tensor:
        """The CPU buffer whose 0-d views are these states' ``step`` tensors: the cached one
        when each state still holds the view installed last time (the cache holds the views,
        so identity is safe), else a new buffer with the current values and new views."""
        cached = self._steps.get(gi)
        if cached is not None:
            views, buf = cached
            if len(views) == len(states) and all(
                s["step"] is view for s, view in zip(states, views, strict=True)
            ):
                return buf
        buf = torch.stack(
            [torch.as_tensor(s["step"], dtype=torch.float32).reshape(()).cpu() for s in states]
        )
        views = list(buf.unbind(0))
        for s, view in zip(states, views, strict=True):
            s["step"] = view
        self._steps[gi] = (views, buf)
        return buf


_F32 = torch.float32


def _quick_ok(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor) -> bool:
    """What :func:`_check_all` checks of a parameter and its gradient, as plain attribute
    reads (no messages built), for states already checked (``m`` stands for both: they
    were made, or loaded and checked, together with one shape)."""
    return (
        g.dtype is _F32
        and p.dtype is _F32
        and p.is_cuda
        and not g.is_sparse
        and p.is_contiguous()
        and g.shape == p.shape == m.shape
        and g.get_device() == p.get_device() == m.get_device()
    )


def _check_all(p: torch.Tensor, state: dict[str, Any], where: str) -> None:
    """The named checks of one parameter, its gradient and its states (raises on the first)."""
    _check_param(p, where)
    assert p.grad is not None
    _check_like(p.grad, p, f"{where}.grad", (torch.float32,), dense=False)
    _check_like(state["exp_avg"], p, f"{where} state['exp_avg']", (torch.float32,))
    _check_like(state["exp_avg_sq"], p, f"{where} state['exp_avg_sq']", (torch.float32,))
