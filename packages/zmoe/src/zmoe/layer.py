"""``zmoe.MoE``: DeepSpeed's MoE layer (same signature, same outputs), with a dropless path,
sigmoid/aux-loss-free routing and expert parallelism over the job mesh's ``ep`` axis."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zcore.comm.collectives import Comm
from zcore.zero import register_external_parameter
from zmoe import capacity, dropless
from zmoe.experts import Experts
from zmoe.gating import NOISY_POLICIES, ROUTERS, Routing, TopKRouter
from zmoe.parallel import all_to_all, exchange_counts

#: Dropless at ``ep_size=1`` with batched experts: pad every expert to the busiest one's
#: routes (one batched GEMM per layer) while ``E * max_load <= PAD_LIMIT * routes``, else
#: run each expert on its own sorted slice. On a 2-core CPU under load, one ``bmm`` over
#: 8 experts ran 2-2.5x faster than their 8 ``mm`` (the threads meet once, not 8 times).
PAD_LIMIT = 1.5


@dataclass
class MoEStats:
    """What the last forward of one layer did on this rank (tensors are detached).

    Bytes count the token rows of this rank's all-to-alls, the block a rank keeps for its
    own experts included (it is part of the collective's buffer): ``dispatch_bytes`` is the
    size of the dispatch all-to-all's input (this rank's routed token rows, sent), and
    ``combine_bytes`` the size of the combine all-to-all's output (the results of those same
    rows, received back). Dropless, both are ``kept routes x d x element size`` = ``k*T*d*es``
    with every token routed; on the capacity path both are the padded buffer, ``E*C*d*es``.
    Both are 0 at ``ep_size=1``, where no all-to-all runs.
    """

    tokens: int
    """T: tokens this rank fed the layer."""
    routes: Tensor
    """Routes asked for (``k*T`` unless ``used_token`` masked some)."""
    expert_load: Tensor
    """[E] routes each global expert processed for this rank's tokens (after drops)."""
    capacity: int
    """Slots per expert (capacity path); 0 when dropless."""
    dispatch_bytes: int
    combine_bytes: int
    aux_loss: Tensor
    """The load-balancing loss alone."""
    z_loss: Tensor
    """The router z-loss, unscaled."""

    @property
    def dropped_routes(self) -> int:
        return int(self.routes - self.expert_load.sum())

    @property
    def dropped_fraction(self) -> float:
        """Share of the routes the capacity limit dropped (0.0 dropless)."""
        routes = int(self.routes)
        return self.dropped_routes / routes if routes else 0.0


class MoE(nn.Module):
    """A mixture-of-experts layer; ``forward(x)`` returns ``(out, l_aux, exp_counts)``.

    The positional arguments are DeepSpeed's ``deepspeed.moe.layer.MoE`` (0.19.8); with the
    same weights, ``drop_tokens=True`` and ``use_rts=False`` (and
    ``top2_2nd_expert_sampling=False`` for k=2) its outputs, ``l_aux`` and ``exp_counts``
    are DeepSpeed's, and with ``drop_tokens=False`` its outputs are. Differences: Random
    Token Selection and the top-2 Gumbel sampling apply in training only (DeepSpeed also
    applies them in eval); ``use_tutel`` is accepted and ignored (the index dispatch is
    what Tutel adds); expert tensor parallelism is not built.

    Keyword-only additions:

    * ``router``: ``"softmax"`` (DeepSpeed's) or ``"sigmoid"`` (DeepSeek-V3: per-expert
      sigmoid scores, weights renormalized over the chosen k when k > 1).
    * ``z_loss_coef``: adds ``z_loss_coef * mean(logsumexp(logits)^2)`` to the returned
      ``l_aux`` (ST-MoE's router z-loss).
    * ``aux_loss_free_bias``: a per-expert bias added to the scores for selection only,
      moved by ``bias_update_rate`` against the sign of each expert's load error after every
      training forward (loads summed over the job when a mesh is bound).

    Expert parallelism: with ``ep_size > 1`` this rank (``ep`` coordinate ``rank % ep_size``)
    builds experts ``[ep_rank*E_local, (ep_rank+1)*E_local)`` only; call :meth:`bind_mesh`
    (``zcore.initialize`` does) before the first forward.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        *,
        router: str = "softmax",
        z_loss_coef: float = 0.0,
        aux_loss_free_bias: bool = False,
        bias_update_rate: float = 1e-3,
    ) -> None:
        super().__init__()
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        _validate(num_experts, ep_size, k, capacity_factor, eval_capacity_factor, world)
        if noisy_gate_policy not in NOISY_POLICIES:
            raise ValueError(
                f"noisy_gate_policy {noisy_gate_policy!r} is not one of {NOISY_POLICIES}"
            )
        if router not in ROUTERS:
            raise ValueError(f"router {router!r} is not one of {ROUTERS}")
        if enable_expert_tensor_parallelism:
            raise ValueError("enable_expert_tensor_parallelism: tensor parallelism is not built")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.k = k
        self.num_local_experts = num_experts // ep_size
        self.ep_rank = dist.get_rank() % ep_size if ep_size > 1 else 0
        self.drop_tokens = drop_tokens
        self.use_residual = use_residual
        self.z_loss_coef = z_loss_coef
        self.bias_update_rate = bias_update_rate
        self.gate = TopKRouter(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
            router,
            aux_loss_free_bias,
        )
        first = self.ep_rank * self.num_local_experts
        self.experts = Experts(expert, first, self.num_local_experts)
        if use_residual:
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)
        # the gate and the grouped GEMMs read their weights without calling the modules that
        # own them: at ZeRO stage 3 this layer's forward gathers them all
        for p in self.parameters():
            register_external_parameter(self, p)
        self._ep_comm: Comm | None = None
        self._world_comm: Comm | None = None
        self.last_stats: MoEStats | None = None
        """What the last forward did (drops, per-expert load, all-to-all bytes)."""

    # -- the engine protocol ---------------------------------------------------------------
    def mesh_axes(self) -> dict[str, int]:
        """The mesh axes this layer needs: ``{"ep": ep_size}``."""
        return {"ep": self.ep_size}

    def bind_mesh(self, mesh: Any) -> None:
        """Take the all-to-alls' group from ``mesh`` (a :class:`zcore.comm.mesh.Mesh`)."""
        size, coordinate = mesh.size("ep"), mesh.coordinate("ep")
        if size != self.ep_size:
            raise ValueError(
                f"the mesh's ep axis has size {size} but this MoE layer has ep_size "
                f"{self.ep_size}; build the mesh with MeshSpec.resolve(world, ep={self.ep_size})"
            )
        if coordinate != self.ep_rank:
            raise ValueError(
                f"rank {mesh.rank} is ep coordinate {coordinate} in the mesh but this layer "
                f"built experts for ep rank {self.ep_rank} (rank % ep_size {self.ep_size}); "
                "the mesh must order the expert view (pp, edp, ep, tp), ep innermost"
            )
        self._ep_comm = mesh.comm("ep") if self.ep_size > 1 else None
        self._world_comm = mesh.comm("world")

    def _comm(self) -> Comm | None:
        if self.ep_size == 1:
            return None
        if self._ep_comm is None:
            raise RuntimeError(
                f"this MoE layer has ep_size {self.ep_size} but no mesh: call "
                "`layer.bind_mesh(mesh)` with `zcore.comm.mesh.job_mesh(MeshSpec.resolve(world, "
                f"ep={self.ep_size}), timeout_s)`, or build the engine with `zcore.initialize`"
            )
        return self._ep_comm

    # -- forward ---------------------------------------------------------------------------
    def forward(
        self, hidden_states: Tensor, used_token: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``hidden_states`` [..., hidden] -> ``(out [..., hidden], l_aux, exp_counts [E])``;
        ``used_token`` [T] (k=1 only, as DeepSpeed) masks tokens out of routing."""
        comm = self._comm()
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, d]
        routing = self.gate(x, used_token)
        if self.drop_tokens:
            out, load, sent, back = self._capacity(x, routing, comm)
        else:
            out, load, sent, back = self._dropless(x, routing, comm)
        l_aux = routing.l_aux
        if self.z_loss_coef:
            l_aux = l_aux + self.z_loss_coef * routing.z_loss
        if self.gate.aux_loss_free_bias and self.training:
            self._update_bias(routing.exp_counts)
        self.last_stats = MoEStats(
            tokens=x.shape[0],
            routes=(routing.exp_counts.sum()).detach(),
            expert_load=load.detach(),
            capacity=routing.capacity,
            dispatch_bytes=sent,
            combine_bytes=back,
            aux_loss=routing.l_aux.detach(),
            z_loss=routing.z_loss.detach(),
        )
        out = out.reshape(hidden_states.shape)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            out = out * coef[..., 0:1] + dense * coef[..., 1:]
        return out, l_aux, routing.exp_counts

    def _capacity(
        self, x: Tensor, routing: Routing, comm: Comm | None, slots_per_expert: int = 0
    ) -> tuple[Tensor, Tensor, int, int]:
        e, c, d = self.num_experts, slots_per_expert or routing.capacity, x.shape[1]
        slots = capacity.route_slots(routing.indices, routing.locations, e, c)
        routes = capacity.slot_routes(slots, e, c)
        buf = capacity.encode(x, slots, routes)  # [E*C, d], experts rank by rank
        load = torch.bincount(routing.indices[routing.indices >= 0], minlength=e)
        if comm is None:  # experts run on their filled slots only (kept routes fill in order)
            filled = load.clamp_max(c).tolist()
            y = self.experts.run_buffer(buf.view(e, c, d), filled).reshape(e * c, d)
            return capacity.decode(y, slots, routes, routing.gates), load, 0, 0
        ep, local = self.ep_size, self.num_local_experts
        # Every rank's buffer has the same E*C rows (same T on every rank, as DeepSpeed).
        recv = all_to_all(buf, comm, "zmoe dispatch")  # [ep (source), E_local, C, d]
        recv = recv.view(ep, local, c, d).transpose(0, 1).reshape(local, ep * c, d)
        y = self.experts.run_buffer(recv)
        y = y.view(local, ep, c, d).transpose(0, 1).reshape(e * c, d)
        y = all_to_all(y, comm, "zmoe combine")
        nbytes = buf.numel() * buf.element_size()
        return capacity.decode(y, slots, routes, routing.gates), load, nbytes, nbytes

    def _dropless(
        self, x: Tensor, routing: Routing, comm: Comm | None
    ) -> tuple[Tensor, Tensor, int, int]:
        if comm is None and self.experts.batched(x):
            # One batched GEMM per layer over a buffer padded to the busiest expert, unless
            # the padding would cost more than the batching saves (a skewed router).
            load = torch.bincount(routing.indices[routing.indices >= 0], minlength=self.num_experts)
            most, routes = (int(v) for v in torch.stack([load.max(), load.sum()]).tolist())
            if most and self.num_experts * most <= PAD_LIMIT * routes:
                return self._capacity(x, routing, comm, slots_per_expert=most)
        plan = dropless.plan(routing.indices, routing.gates, self.num_experts)
        rows = dropless.gather(x, plan)  # [R, d] in global expert order
        if comm is None:
            y = self.experts.run_slices(rows, plan.counts.tolist())
            return dropless.combine(y, plan, x.shape[0]), plan.counts, 0, 0
        ep = self.ep_size
        recv_counts = exchange_counts(plan.counts, comm, "zmoe dispatch counts")  # [ep, E_local]
        send = plan.counts.view(ep, -1).sum(dim=1).tolist()
        got = recv_counts.sum(dim=1).tolist()
        recv = all_to_all(rows, comm, "zmoe dispatch", got, send)  # (source, expert) order
        perm = dropless.expert_major(recv_counts)
        y = self.experts.run_slices(dropless.by_expert(recv, perm), recv_counts.sum(0).tolist())
        y = all_to_all(dropless.by_source(y, perm), comm, "zmoe combine", send, got)
        sent = rows.numel() * rows.element_size()
        back = y.numel() * y.element_size()
        return dropless.combine(y, plan, x.shape[0]), plan.counts, sent, back

    def _update_bias(self, counts: Tensor) -> None:
        load = counts.float()
        if self._world_comm is not None and self._world_comm.size > 1:
            self._world_comm.all_reduce(load, "zmoe expert load").wait()
        self.gate.update_bias(load, self.bias_update_rate)


def _validate(
    num_experts: int, ep_size: int, k: int, factor: float, eval_factor: float, world: int
) -> None:
    if num_experts < 1 or ep_size < 1:
        raise ValueError(f"num_experts {num_experts} and ep_size {ep_size} must be at least 1")
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts {num_experts} is not divisible by ep_size {ep_size}; choose an "
            f"ep_size that divides {num_experts}"
        )
    if not 1 <= k <= num_experts:
        raise ValueError(f"k {k} must be between 1 and num_experts {num_experts}")
    if factor <= 0 or eval_factor <= 0:
        raise ValueError(
            f"capacity_factor {factor} and eval_capacity_factor {eval_factor} must be positive"
        )
    if world % ep_size:
        raise ValueError(
            f"ep_size {ep_size} does not divide the world size {world}; choose an ep_size that "
            f"divides {world}"
            + ("" if world > 1 else " (torch.distributed is not initialized: world size 1)")
        )
