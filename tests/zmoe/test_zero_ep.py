"""MoE under the ZeRO engine: expert parallelism with ZeRO stages 1-3 equals one process.

A small LM with one ``zmoe.MoE`` layer (4 experts) trains for 10 steps on real gloo ranks,
its experts spread over ``ep`` ranks and cut across the expert-data-parallel ranks
(``zero_axis = "edp"``), the dense parameters across ``dp``. The baseline is the same model
at ``ep_size=1`` in one process, stepping on the same global batches, each rank's micro
batch a forward of its own (the aux loss and the capacity are per forward, as on a rank).
Gradient clipping is on, so the global norm must count every expert once across ``ep``.

Tolerances as in ``tests/zcore/zero/test_equivalence.py``: fp32 losses to 2e-5, parameters
to 1e-4 after 10 steps (summation order and the native AdamW kernel differ).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zcore
import zmoe
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import VOCAB, config, full_params, micro_batch, train
from tests.zmoe.moe_utils import mlp, seed_experts

D, EXPERTS, STEPS, MB, GAS = 16, 4, 10, 2, 2
CASES: dict[str, dict[str, Any]] = {
    "top1": {"k": 1, "use_rts": False},
    "top2": {"k": 2, "top2_2nd_expert_sampling": False},
    "dropless": {"k": 2, "drop_tokens": False},
    "residual": {"k": 1, "drop_tokens": False, "use_residual": True},
}


class MoELM(nn.Module):
    """Embedding → residual MoE layers → LayerNorm → head; loss = CE + aux_coef * l_aux.

    ``experts`` gives each layer's expert count (PR-MoE's pyramid: more in later layers).
    """

    def __init__(
        self, ep: int = 1, aux_coef: float = 0.01, experts: tuple[int, ...] = (EXPERTS,), **moe: Any
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(
            zmoe.MoE(D, mlp(D, 2 * D), num_experts=e, ep_size=ep, **moe) for e in experts
        )
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.aux_coef = aux_coef
        for i, layer in enumerate(self.layers):
            seed_experts(layer, seed=i)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        aux = 0.0
        for layer in self.layers:
            h, l_aux, _ = layer(x.reshape(-1, D))
            x = x + h.view_as(x)
            aux = aux + l_aux
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1)) + self.aux_coef * aux


def make(
    ep: int, case: dict[str, Any], aux_coef: float = 0.01, experts: tuple[int, ...] = (EXPERTS,)
) -> MoELM:
    """The model at ``ep``, with the ``ep_size=1`` model's weights (experts by global name)."""
    ref = MoELM(1, aux_coef, experts, **case)
    if ep == 1:
        return ref
    model = MoELM(ep, aux_coef, experts, **case)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in ref.state_dict().items() if k in own})
    return model


def baseline(
    case: dict[str, Any],
    world: int,
    steps: int,
    start: int = 0,
    aux_coef: float = 0.01,
    experts: tuple[int, ...] = (EXPERTS,),
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make(1, case, aux_coef, experts)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(steps + start):
        total = 0.0
        for micro in range(GAS):
            for rank in range(world):
                x, y = micro_batch(step, micro, rank, world, MB, GAS)
                loss = model(x, y)
                (loss / (world * GAS)).backward()
                total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        if step >= start:
            losses.append(total / (world * GAS))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_all(rank: int, world: int, ep: int, stages: tuple[int, ...]) -> dict:
    out = {}
    for stage in stages:
        for name, case in CASES.items():
            engine, *_ = zcore.initialize(make(ep, case), config=config(stage, mb=MB, gas=GAS))
            assert engine.mesh.spec.ep == ep
            axes = engine.zopt.group_axis
            assert axes == ["dp", "edp"], axes
            losses = train(engine, STEPS)
            out[(stage, name)] = (losses, full_params(engine))
            engine.destroy()
    return out


def _check(results: list[dict], world: int) -> None:
    for name, case in CASES.items():
        ref_losses, ref_params = baseline(case, world, STEPS)
        for rank, r in enumerate(results):
            for (stage, case_name), (losses, params) in r.items():
                if case_name != name:
                    continue
                where = f"{name} stage {stage} rank {rank}"
                assert losses == pytest.approx(ref_losses, rel=2e-5, abs=2e-5), where
                for key, value in params.items():  # the dense ones and this rank's experts
                    torch.testing.assert_close(
                        value, ref_params[key], atol=1e-4, rtol=0, msg=f"{where} {key}"
                    )


def test_ep2_with_zero_1_2_3_equals_one_process() -> None:
    _check(run_ranks(_train_all, 2, args=(2, (1, 2, 3)), timeout=600), 2)


@pytest.mark.slow
def test_ep2_edp2_with_zero_1_2_3_equals_one_process() -> None:
    _check(run_ranks(_train_all, 4, args=(2, (1, 2, 3)), timeout=900), 4)


@pytest.mark.slow
def test_ep4_with_zero_1_2_3_equals_one_process() -> None:
    _check(run_ranks(_train_all, 4, args=(4, (1, 2, 3)), timeout=900), 4)


# -- checkpoints across ep and data-parallel sizes ---------------------------------------
CKPT_CASE = CASES["dropless"]
SAVED_AT = 5


def _save(rank: int, world: int, ep: int, stage: int, ckpt: str, aux: float, mb: int = MB) -> list:
    engine, *_ = zcore.initialize(make(ep, CKPT_CASE, aux), config=config(stage, mb=mb, gas=GAS))
    losses = train(engine, SAVED_AT)
    engine.save_checkpoint(ckpt, tag="t")
    return losses


def _resume(rank: int, world: int, ep: int, stage: int, ckpt: str, aux: float, mb: int) -> list:
    engine, *_ = zcore.initialize(make(ep, CKPT_CASE, aux), config=config(stage, mb=mb, gas=GAS))
    engine.load_checkpoint(ckpt, tag="t")
    return train(engine, 3, start=SAVED_AT)


def test_checkpoint_saved_at_ep2_continues_at_ep1(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_save, 2, args=(2, 3, ckpt, 0.01))
    manifest = json.loads((tmp_path / "ckpt" / "t" / "manifest.json").read_text())
    assert manifest["axes"] == ["dp", "edp"] and manifest["mesh"]["ep"] == 2
    assert set(manifest["files"]) == {"rank_00000.pt", "rank_00001.pt"}
    assert {f["ep"] for f in manifest["files"].values()} == {0, 1}
    # the experts, whole, one per global name, from the two ep ranks' files
    sd = zcore.checkpoint.consolidate(str(tmp_path / "ckpt"), "t")
    assert {k for k in sd if k.startswith("layers.0.experts.")} == {
        f"layers.0.experts.{e}.{i}.{w}"
        for e in range(EXPERTS)
        for i in (0, 2)
        for w in ("weight", "bias")
    }
    resumed = run_ranks(_resume, 2, args=(1, 1, ckpt, 0.01, MB))
    ref, _ = baseline(CKPT_CASE, 2, 3, start=SAVED_AT)
    for losses in resumed:
        assert losses == pytest.approx(ref, rel=2e-5, abs=2e-5)


@pytest.mark.slow
def test_checkpoint_moves_between_ep_and_data_parallel_sizes(tmp_path: Path) -> None:
    # no aux loss: with dropless routing the loss is then the same however the global batch
    # is split into forwards, so a run on 4 ranks can continue on 2 and on 1, and back
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_save, 4, args=(2, 2, ckpt, 0.0))
    ref, _ = baseline(CKPT_CASE, 4, 3, start=SAVED_AT, aux_coef=0.0)
    for world, ep in ((2, 1), (2, 2), (1, 1)):
        for losses in run_ranks(_resume, world, args=(ep, 3, ckpt, 0.0, MB * 4 // world)):
            assert losses == pytest.approx(ref, rel=2e-5, abs=2e-5), (world, ep)
    # and the other way: one process (ep 1) to 4 ranks at ep 2 and ep 4
    ckpt = str(tmp_path / "ckpt1")
    run_ranks(_save, 1, args=(1, 2, ckpt, 0.0, MB * 4))
    for ep in (2, 4):
        for losses in run_ranks(_resume, 4, args=(ep, 3, ckpt, 0.0, MB)):
            assert losses == pytest.approx(ref, rel=2e-5, abs=2e-5), (4, ep)


# -- offloaded expert state ---------------------------------------------------------------
def _offloaded(rank: int, world: int, root: str) -> dict:
    nvme = {"device": "nvme", "nvme_path": root}
    setups = {
        "stage 2, optimizer on cpu": (2, {"offload_optimizer": {"device": "cpu"}}),
        "stage 3, optimizer on nvme, parameters on cpu": (
            3,
            {"offload_optimizer": nvme, "offload_param": {"device": "cpu"}},
        ),
    }
    out = {}
    for what, (stage, zero) in setups.items():
        cfg = config(stage, mb=MB, gas=GAS, zero_optimization=zero)
        engine, *_ = zcore.initialize(make(2, CASES["dropless"]), config=cfg)
        out[what] = (train(engine, STEPS), full_params(engine))
        engine.destroy()
    return out


def test_ep2_with_offloaded_expert_state_equals_one_process(tmp_path: Path) -> None:
    results = run_ranks(_offloaded, 2, args=(str(tmp_path),), timeout=600)
    ref_losses, ref_params = baseline(CASES["dropless"], 2, STEPS)
    for rank, r in enumerate(results):
        for what, (losses, params) in r.items():
            assert losses == pytest.approx(ref_losses, rel=2e-5, abs=2e-5), (what, rank)
            for key, value in params.items():
                torch.testing.assert_close(
                    value, ref_params[key], atol=1e-4, rtol=0, msg=f"{what} rank {rank} {key}"
                )


# -- PR-MoE: a pyramid of expert counts with the residual expert ---------------------------
PYRAMID = (2, 4)


def _pyramid(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    case = CASES["residual"]
    engine, *_ = zcore.initialize(make(2, case, experts=PYRAMID), config=config(3, mb=MB, gas=GAS))
    return train(engine, STEPS), full_params(engine)


def test_pyramid_residual_moe_at_ep2_stage3_equals_one_process() -> None:
    ref_losses, ref_params = baseline(CASES["residual"], 2, STEPS, experts=PYRAMID)
    for rank, (losses, params) in enumerate(run_ranks(_pyramid, 2)):
        assert losses == pytest.approx(ref_losses, rel=2e-5, abs=2e-5), rank
        # each rank holds half of each layer's experts: 1 of 2, then 2 of 4
        held = {k.split(".")[3] for k in params if k.startswith("layers.1.experts.")}
        assert held == {str(2 * rank), str(2 * rank + 1)}, held
        for key, value in params.items():
            torch.testing.assert_close(value, ref_params[key], atol=1e-4, rtol=0, msg=key)


def _load_into_wider_experts(rank: int, world: int, ckpt: str) -> str:
    model = make(2, CKPT_CASE)
    for expert in model.layers[0].experts.values():  # experts 3*D wide instead of 2*D
        expert[0], expert[2] = nn.Linear(D, 3 * D), nn.Linear(3 * D, D)
        for p in expert.parameters():
            p.zero_axis = "edp"
    engine, *_ = zcore.initialize(model, config=config(2, mb=MB, gas=GAS))
    try:
        engine.load_checkpoint(ckpt, tag="t")
    except zcore.checkpoint.CheckpointError as err:
        return str(err)
    return "loaded"


def test_checkpoint_refuses_experts_of_another_shape(tmp_path: Path) -> None:
    # expert layouts come from the rank files (each ep rank holds other experts): experts
    # of another shape are refused on every rank, naming the parameter, engine unchanged
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_save, 2, args=(2, 3, ckpt, 0.01))
    for msg in run_ranks(_load_into_wider_experts, 2, args=(ckpt,)):
        assert "layers.0.experts." in msg and "shape" in msg, msg
        assert "nothing was loaded" in msg, msg
