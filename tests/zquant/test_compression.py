"""The compression composer on all-MiniLM-L6-v2 with a DeepSpeed `compression_training` JSON.

Weight quantization (INT8, offset 5) and sparse pruning (dense 0.5, offset 10) share the
attention q/k/v layers; row pruning (dense 0.5, offset 12) halves the FFN. A short real
training loop (self-distillation on Shakespeare sentences) steps the scheduler; the weights
show each method switching on at its step, and `redundancy_clean` then shrinks the FFN with
unchanged outputs.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from torch import nn

from tests.zquant.compress_utils import encode, minilm, pooled, shakespeare_sentences
from zquant.clean import count_parameters
from zquant.compression import (
    CompressionConfigError,
    compression_scheduler,
    init_compression,
    load_compression_config,
    redundancy_clean,
)

DS_CONFIG = json.loads(
    r"""
{
  "train_batch_size": 8,
  "compression_training": {
    "weight_quantization": {
      "shared_parameters": {
        "enabled": true, "quantizer_kernel": false, "schedule_offset": 5,
        "quantize_groups": 1, "quantize_verbose": false, "quantization_type": "symmetric",
        "quantize_weight_in_forward": true, "rounding": "nearest",
        "fp16_mixed_quantize": {"enabled": false, "quantize_change_ratio": 0.001}
      },
      "different_groups": {
        "wq1": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0},
                "modules": ["attention.self"]}
      }
    },
    "sparse_pruning": {
      "shared_parameters": {"enabled": true, "schedule_offset": 10, "method": "l1"},
      "different_groups": {
        "sp1": {"params": {"dense_ratio": 0.5}, "modules": ["attention.self"]}
      }
    },
    "row_pruning": {
      "shared_parameters": {"enabled": true, "schedule_offset": 12, "method": "l1"},
      "different_groups": {
        "rp1": {"params": {"dense_ratio": 0.5}, "modules": ["intermediate.dense"],
                "related_modules": [["layer.\\w+.output.dense"]]}
      }
    }
  }
}
"""
)


def _query(model: nn.Module) -> nn.Linear:
    return model.encoder.layer[2].attention.self.query


def test_methods_switch_on_at_their_offsets_and_clean_up() -> None:
    torch.manual_seed(0)
    teacher = minilm()
    model = init_compression(copy.deepcopy(teacher), DS_CONFIG)
    scheduler = compression_scheduler(model, DS_CONFIG)
    sentences = shakespeare_sentences()
    batches = [encode(sentences[i : i + 8], max_length=32) for i in range(0, 8 * 4, 8)]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    query, ffn = _query(model), model.encoder.layer[2].intermediate.dense

    def latent() -> torch.Tensor:
        return query.parametrizations.weight.original.detach()

    seen: dict[int, dict[str, float]] = {}
    for step in range(1, 14):
        batch = batches[step % len(batches)]
        with torch.no_grad():
            target = pooled(teacher, batch)
        loss = (pooled(model, batch) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        scheduler.step()
        assert scheduler.training_steps == step
        with torch.no_grad():
            w = query.weight
            seen[step] = {
                "quantized": float(not torch.equal(w, latent())),
                "levels": float(torch.unique(w).numel()),
                "zeros": float((w == 0).float().mean()),
                "zero_rows": float((ffn.weight.abs().sum(1) == 0).sum()),
            }
        if step == 4:  # nothing on yet: the effective weight is the trained latent weight
            assert seen[4]["quantized"] == 0.0 and seen[4]["zeros"] == 0.0
            assert seen[4]["zero_rows"] == 0.0
            assert scheduler.active() == {
                "sparse_pruning": False,
                "row_pruning": False,
                "weight_quantization": False,
            }
        if step == 5:  # INT8 on: at most 255 levels (one scale per tensor), no pruning yet
            assert seen[5]["quantized"] == 1.0 and seen[5]["levels"] <= 255
            assert seen[5]["zeros"] < 0.02 and seen[5]["zero_rows"] == 0.0
        if step == 10:  # sparse on top of INT8: half the weights are zero, still <= 255 levels
            assert seen[10]["zeros"] == pytest.approx(0.5, abs=0.01)
            assert seen[10]["levels"] <= 255 and seen[10]["zero_rows"] == 0.0
        if step == 12:  # row pruning: exactly half of the 1536 FFN rows (and biases) are zero
            assert seen[12]["zero_rows"] == 768.0
            assert int((ffn.bias == 0).sum()) == 768
    assert seen[11]["zero_rows"] == 0.0 and seen[13]["zeros"] == pytest.approx(0.5, abs=0.01)

    batch = encode(sentences[100:116])
    model.to(torch.float64)
    with torch.no_grad():
        masked = model(**batch).last_hidden_state
    before = count_parameters(model)
    redundancy_clean(model, DS_CONFIG)
    after = count_parameters(model)
    with torch.no_grad():
        cleaned = model(**batch).last_hidden_state
    # 768 of 1536 FFN rows per layer: 768*384 + 768 (bias) + 384*768 (output.dense inputs).
    assert before - after == 6 * (768 * 384 + 768 + 384 * 768)
    assert model.encoder.layer[0].output.dense.in_features == 768
    assert torch.allclose(cleaned, masked, atol=1e-10, rtol=0)
    # Quantization and the sparse mask's zeros survive the clean-up.
    assert torch.unique(_query(model).weight).numel() <= 255


def test_bits_step_down_and_activation_quantization_switches_on() -> None:
    config = {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 2, "quantize_groups": 4},
            "different_groups": {
                "wq": {
                    "params": {"start_bits": 8, "target_bits": 4, "quantization_period": 3},
                    "modules": [r"layer\.0\.intermediate"],
                }
            },
        },
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 3},
            "different_groups": {"aq": {"params": {"bits": 4}, "modules": ["output.dense"]}},
        },
    }
    model = init_compression(minilm(), config)
    scheduler = compression_scheduler(model)
    quant = model.encoder.layer[0].intermediate.dense.parametrizations.weight[0]
    batch = encode(shakespeare_sentences()[:4])
    with torch.no_grad():
        outputs = [model(**batch).last_hidden_state]
    bits = []
    for _ in range(12):
        scheduler.step()
        bits.append(quant.bits if quant.enabled else None)
        if scheduler.training_steps in (2, 3):
            with torch.no_grad():
                outputs.append(model(**batch).last_hidden_state)
    # on at 2 with 8 bits, one bit fewer every 3 steps, floored at the target 4
    assert bits == [None, 8, 8, 8, 7, 7, 7, 6, 6, 6, 5, 5]
    assert not torch.equal(outputs[0], outputs[1])  # weights quantized at step 2
    assert not torch.equal(outputs[1], outputs[2])  # 4-bit activations on at step 3


def test_layer_reduction_keeps_teacher_layers() -> None:
    teacher = minilm()
    config = {
        "layer_reduction": {
            "enabled": True,
            "keep_number_layer": 3,
            "module_name_prefix": "encoder.layer",
            "teacher_layer": [1, 3, 5],
            "other_module_name": ["embeddings", "pooler"],
        }
    }
    student = init_compression(teacher, config, teacher_model=teacher)
    assert len(student.encoder.layer) == 3 and student.config.num_hidden_layers == 3
    assert torch.equal(
        student.encoder.layer[1].output.dense.weight, teacher.encoder.layer[3].output.dense.weight
    )
    with torch.no_grad():
        out = student(**encode(shakespeare_sentences()[:2])).last_hidden_state
    assert out.shape[-1] == 384 and torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"sparse_pruning": {"shared_parameters": {"enabled": True, "dense_ratio": 0.5}}},
            re.escape(
                "compression_training.sparse_pruning.shared_parameters: unknown key "
                "'dense_ratio'; valid keys are ['enabled', 'method', 'schedule_offset']"
            ),
        ),
        ({"weight_quantisation": {}}, "unknown key 'weight_quantisation'"),
        (
            {
                "row_pruning": {
                    "shared_parameters": {"enabled": True, "method": "snip"},
                    "different_groups": {"g": {"params": {"dense_ratio": 0.5}}},
                }
            },
            re.escape("row_pruning.shared_parameters.method: 'snip' is not one of ['l1', 'topk']"),
        ),
        (
            {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True},
                    "different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 8}}},
                }
            },
            r"different_groups.g.params.target_bits: 8 is outside \[1, 4\]",
        ),
        (
            {
                "head_pruning": {
                    "shared_parameters": {"enabled": True},
                    "different_groups": {"g": {"params": {"dense_ratio": 0.5}}},
                }
            },
            "head_pruning.shared_parameters.num_heads: 0; set the attention's head count",
        ),
        (
            {"layer_reduction": {"enabled": True, "keep_number_layer": 2, "teacher_layer": [1]}},
            r"keep_number_layer 2 != len\(teacher_layer\) 1",
        ),
        (
            {"sparse_pruning": {"shared_parameters": {"enabled": True}}},
            "different_groups` is empty",
        ),
    ],
)
def test_bad_configs_name_the_key(config: dict, message: str) -> None:
    with pytest.raises(CompressionConfigError, match=message):
        load_compression_config(config)


def test_pattern_matching_nothing_is_named() -> None:
    config = {
        "sparse_pruning": {
            "shared_parameters": {"enabled": True},
            "different_groups": {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["mlp.fc9"]}},
        }
    }
    with pytest.raises(CompressionConfigError, match=r"different_groups.sp.modules: 'mlp.fc9' "):
        init_compression(nn.Sequential(nn.Linear(4, 4)), config)
