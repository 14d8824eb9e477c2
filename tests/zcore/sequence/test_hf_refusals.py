"""Ulysses on a Hugging Face model refuses, before any collective and naming the numbers and
the fix: an attention implementation whose kernel would see one slice, a model whose attention
does not dispatch through transformers' AttentionInterface, a sequence shorter than cp, a
padding mask with zeros. The cp=2 cases use the ``Comm`` of a 2-rank axis; each refusal comes
before that comm would send anything, so one process checks them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from zcore.comm import Comm
from zcore.sequence import SequenceParallelError
from zcore.sequence.hf import parallelize

HEADS = {"hidden_size": 36, "num_attention_heads": 9, "num_key_value_heads": 3}


def _tiny() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        intermediate_size=48,
        num_hidden_layers=1,
        max_position_embeddings=64,
        **HEADS,
    )
    return LlamaForCausalLM(config)


def _cp2() -> Comm:
    return Comm(None, 0, 2, 60.0, axis="cp")


@pytest.mark.parametrize("impl", ["flex_attention", "flash_attention_2"])
def test_an_attention_kernel_that_sees_one_slice_is_refused(impl: str) -> None:
    model = _tiny()
    model.config._attn_implementation_internal = impl
    with pytest.raises(SequenceParallelError, match=rf"'{impl}' cannot be wrapped.*'sdpa'"):
        parallelize(model, _cp2())


def test_a_model_without_the_attention_interface_is_refused(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    model.config = type("Config", (), {"_attn_implementation": "sdpa"})()
    with pytest.raises(SequenceParallelError, match="Sequential's attention cannot be wrapped"):
        parallelize(model, _cp2())


def test_a_sequence_shorter_than_cp_is_refused() -> None:
    model = parallelize(_tiny(), _cp2())
    ids = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(SequenceParallelError, match=r"1 tokens .* sequence_parallel_size 2"):
        model(input_ids=ids, labels=ids)


def test_a_padding_mask_is_refused() -> None:
    model = parallelize(_tiny(), Comm(None, 0, 1, 60.0, axis="cp"))
    ids = torch.zeros(1, 4, dtype=torch.int64)
    mask = torch.tensor([[1, 1, 1, 0]])
    with pytest.raises(SequenceParallelError, match="padding mask with zeros"):
        model(input_ids=ids, attention_mask=mask, labels=ids)
