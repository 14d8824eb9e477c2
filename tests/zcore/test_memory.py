"""`zcore.memory`: the ZeRO model-state formulas, offload bookkeeping, DeepSpeed's
estimator numbers where ours should match them, validation messages and `parse_count`."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zcore.memory import (
    MemoryEstimate,
    format_bytes,
    formula_bytes,
    model_state_bytes,
    parse_count,
)


def paper_formula(psi: int, n: int, stage: int) -> int:
    """ZeRO paper, mixed-precision Adam (2 + 2 + 12 bytes per parameter), N dividing Ψ."""
    assert psi % n == 0
    return {
        0: 16 * psi,
        1: 2 * psi + 2 * psi + 12 * psi // n,
        2: 2 * psi + 2 * psi // n + 12 * psi // n,
        3: 16 * psi // n,
    }[stage]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(
    ("psi", "n"), [(1, 1), (125_000_000, 1), (1_300_000_000, 8), (7_500_000_000, 64)]
)
def test_totals_follow_the_paper(psi: int, n: int, stage: int) -> None:
    e = model_state_bytes(psi, n, stage)
    assert e.total == paper_formula(psi, n, stage) == formula_bytes(psi, n, stage)
    assert e.total == e.params + e.grads + e.optimizer + e.gathered
    assert e.gathered == 0 and e.host_per_rank == e.host_per_node == e.nvme_per_rank == 0


def test_7_5b_on_64_ranks_exact_numbers() -> None:
    # The ZeRO paper's example: 7.5B parameters, N = 64.
    assert formula_bytes(7_500_000_000, 64, 0) == 120_000_000_000
    assert formula_bytes(7_500_000_000, 64, 1) == 31_406_250_000
    assert formula_bytes(7_500_000_000, 64, 2) == 16_640_625_000
    assert formula_bytes(7_500_000_000, 64, 3) == 1_875_000_000
    e = model_state_bytes(7_500_000_000, 64, 3)
    assert (e.params, e.grads, e.optimizer) == (234_375_000, 234_375_000, 1_406_250_000)


def test_shards_round_up_when_n_does_not_divide() -> None:
    # 10 params over 4 ranks: each rank holds a padded shard of 3 elements.
    e = model_state_bytes(10, 4, 3)
    assert (e.params, e.grads, e.optimizer, e.total) == (6, 6, 36, 48)
    assert model_state_bytes(10, 4, 1).total == 2 * 10 + 2 * 10 + 12 * 3


@given(
    psi=st.integers(1, 10**12),
    n=st.integers(1, 4096),
    stage=st.sampled_from([0, 1, 2, 3]),
)
def test_more_sharding_never_costs_more(psi: int, n: int, stage: int) -> None:
    e = model_state_bytes(psi, n, stage)
    assert e.total <= model_state_bytes(psi, n, max(stage - 1, 0)).total
    assert e.total <= 16 * psi
    # ceil(Ψ/N) padding adds at most one element per shard
    shard = Fraction(psi, n)
    exact = {0: 16 * psi, 1: 4 * psi + 12 * shard, 2: 2 * psi + 14 * shard, 3: 16 * shard}
    assert exact[stage] <= e.total <= exact[stage] + 16


def test_custom_widths() -> None:
    # fp32 params and grads, 8-byte optimizer state (e.g. Adam without a master copy)
    e = model_state_bytes(1000, 10, 2, param_bytes=4, grad_bytes=4, optim_bytes_per_param=8)
    assert (e.params, e.grads, e.optimizer) == (4000, 400, 800)


def test_optimizer_offload_to_cpu_moves_state_to_host() -> None:
    psi, n = 1_300_000_000, 8
    shard = psi // n
    for stage in (2, 3):
        base = model_state_bytes(psi, n, stage)
        off = model_state_bytes(psi, n, stage, offload_optimizer="cpu")
        assert off.optimizer == 0 and off.grads == 0
        assert off.params == base.params
        assert off.total == base.total - base.optimizer - base.grads
        assert (off.host_optimizer, off.host_grads, off.host_params) == (12 * shard, 4 * shard, 0)
        assert off.host_per_rank == 16 * shard
        assert off.host_per_node == 16 * shard * n * 3 // 2
        assert off.nvme_per_rank == 0
    # stage 1: gradients are not partitioned, so the device keeps them in full
    s1 = model_state_bytes(psi, n, 1, offload_optimizer="cpu")
    assert (s1.params, s1.grads, s1.optimizer) == (2 * psi, 2 * psi, 0)
    assert s1.host_per_rank == 16 * shard


def test_nvme_offload_reports_nvme_separately() -> None:
    psi, n = 8_000, 8
    shard = psi // n
    e = model_state_bytes(psi, n, 3, offload_optimizer="nvme", offload_param="nvme")
    assert e.total == 0
    # optimizer state, fp16 parameters and the fp32 gradient partition (zoffload swaps it)
    assert e.nvme_per_rank == 12 * shard + 2 * shard + 4 * shard
    assert e.nvme_per_node == e.nvme_per_rank * n
    assert e.host_grads == e.host_per_rank == 0
    e = model_state_bytes(psi, n, 3, offload_optimizer="nvme", offload_param="cpu")
    assert (e.host_params, e.nvme_per_rank) == (2 * shard, 12 * shard + 4 * shard)


def test_param_offload_without_optimizer_offload() -> None:
    e = model_state_bytes(8_000, 8, 3, offload_param="cpu")
    assert (e.params, e.grads, e.optimizer) == (0, 2_000, 12_000)
    assert e.host_params == e.host_per_rank == 2_000


def deepspeed_zero3(psi, largest, gpus_per_node, nodes, cpu_offload, cpu_offload_params):
    """DeepSpeed's `estimate_zero3_model_states_mem_needs` with zero_init=True, written
    down from its definition: (cpu bytes per node, gpu bytes per rank)."""
    total_gpus = gpus_per_node * nodes
    largest_mem = 4 * largest
    if cpu_offload and cpu_offload_params:
        return psi * 18 / nodes * 1.5, largest_mem
    if cpu_offload:
        return psi * 16 / nodes * 1.5, largest_mem + int(2 * psi / total_gpus)
    return largest * 4 * gpus_per_node * 1.5, largest_mem + int(18 * psi / total_gpus)


@pytest.mark.parametrize(("gpus_per_node", "nodes"), [(8, 1), (8, 4), (1, 2)])
def test_stage3_offload_matches_deepspeed(gpus_per_node: int, nodes: int) -> None:
    psi, largest = 13_000_000_000, 325_000_000
    n = gpus_per_node * nodes
    for opt, par in [("cpu", "cpu"), ("cpu", "none")]:
        ours = model_state_bytes(
            psi,
            n,
            3,
            offload_optimizer=opt,
            offload_param=par,
            gpus_per_node=gpus_per_node,
            largest_layer_params=largest,
        )
        cpu, gpu = deepspeed_zero3(psi, largest, gpus_per_node, nodes, True, par == "cpu")
        assert ours.total == gpu
        assert ours.host_per_node == cpu
    # Without offload DeepSpeed counts an fp32 gradient shard: grad_bytes=4 reproduces it.
    ours = model_state_bytes(psi, n, 3, gpus_per_node=gpus_per_node, grad_bytes=4)
    assert ours.total + 4 * largest == deepspeed_zero3(psi, largest, gpus_per_node, nodes, 0, 0)[1]


def test_stage2_offload_matches_deepspeed_on_one_node() -> None:
    # estimate_zero2_model_states_mem_needs(cpu_offload=True): gpu 2Ψ, cpu Ψ * max(4N, 16) * 1.5;
    # up to N = 4 the 16Ψ of offloaded state dominates (beyond, its fp32 model load does).
    psi = 3_000_000_000
    for n in (1, 2, 4):
        e = model_state_bytes(psi, n, 2, offload_optimizer="cpu")
        assert e.total == 2 * psi
        assert e.host_per_node == psi * max(4 * n, 16) * 1.5


def test_largest_layer_adds_gathered_working_set() -> None:
    e = model_state_bytes(1_000_000, 4, 3, largest_layer_params=50_000)
    assert e.gathered == 200_000
    assert e.total == formula_bytes(1_000_000, 4, 3) + 200_000


def test_estimate_is_frozen_and_serialisable() -> None:
    e = model_state_bytes(1000, 2, 2)
    assert isinstance(e, MemoryEstimate)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.total = 0  # type: ignore[misc]
    d = e.to_dict()
    assert d["total"] == e.total and d["stage"] == 2 and d["num_params"] == 1000


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"params": 0}, ["params", "0", ">= 1"]),
        ({"world_size": 0}, ["world_size", "0", ">= 1"]),
        ({"stage": 4}, ["stage", "4", "0, 1, 2, 3"]),
        ({"stage": True}, ["stage", "True"]),
        ({"offload_optimizer": "gpu"}, ["offload_optimizer", "'gpu'", "'cpu'", "'nvme'"]),
        ({"offload_param": "disk"}, ["offload_param", "'disk'", "'none'"]),
        ({"stage": 2, "offload_param": "cpu"}, ["offload_param", "'cpu'", "stage 3", "stage 2"]),
        ({"stage": 0, "offload_optimizer": "cpu"}, ["offload_optimizer", "stage 1, 2 or 3"]),
        ({"gpus_per_node": 3}, ["world_size 8", "gpus_per_node 3"]),
        ({"stage": 2, "largest_layer_params": 10}, ["largest_layer_params=10", "stage 2"]),
        ({"largest_layer_params": 10**6}, ["largest_layer_params 1000000", "params 1000"]),
        ({"additional_buffer_factor": 0.5}, ["additional_buffer_factor", "0.5", ">= 1.0"]),
        ({"param_bytes": 0}, ["param_bytes", "0"]),
    ],
)
def test_validation_messages_carry_the_values(kwargs: dict, words: list[str]) -> None:
    args = {"params": 1000, "world_size": 8, "stage": 3, **kwargs}
    with pytest.raises(ValueError) as info:
        model_state_bytes(**args)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1.3B", 1_300_000_000),
        ("1.3b", 1_300_000_000),
        ("125M", 125_000_000),
        ("125m", 125_000_000),
        ("7K", 7_000),
        ("2T", 2_000_000_000_000),
        ("0.5t", 500_000_000_000),
        ("1.3e9", 1_300_000_000),
        ("7E9", 7_000_000_000),
        ("350000", 350_000),
        ("350_000", 350_000),
        (" 66 ", 66),
        ("6.7 B", 6_700_000_000),
        (42, 42),
    ],
)
def test_parse_count(text: str | int, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize(
    "text", ["", "B", "1.3X", "abc", "1.5", "-1", "inf", "nan", "1e-3", "1.3BB"]
)
def test_parse_count_rejects_with_an_example(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_count(text)
    assert repr(text) in str(info.value) and '"1.3B"' in str(info.value)


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(5 * 2**20) == "5.00 MiB"
    assert format_bytes(2**31) == "2.00 GiB"
    assert format_bytes(3 * 2**50) == "3072.00 TiB"
