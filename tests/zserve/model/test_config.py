"""LlamaConfig parsing: both rotary layouts, defaults, and the errors for unsupported or
missing configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.utils.models import smollm2_dir
from zserve.model import LlamaConfig

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 4096,
}


def test_smollm2_transformers5_layout() -> None:
    c = LlamaConfig.from_dir(smollm2_dir())
    assert c.rope_theta == 100000.0 and c.rope_scaling is None  # from rope_parameters
    assert (c.num_key_value_heads, c.head_dim, c.eos_token_ids) == (3, 64, (2,))
    assert c.tie_word_embeddings and c.rms_norm_eps == pytest.approx(1e-5)


def test_transformers4_layout_and_defaults() -> None:
    c = LlamaConfig.from_dict({**BASE, "rope_theta": 500000.0, "eos_token_id": [128001, 128009]})
    assert c.rope_theta == 500000.0
    # No num_key_value_heads: plain multi-head attention; no head_dim: hidden / heads.
    assert (c.num_key_value_heads, c.head_dim) == (32, 128)
    assert c.eos_token_ids == (128001, 128009) and not c.tie_word_embeddings


def test_llama3_rope_scaling_in_either_layout() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = LlamaConfig.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": scaling})
    new = LlamaConfig.from_dict({**BASE, "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert old.rope_scaling == new.rope_scaling and old.rope_scaling is not None
    assert old.rope_scaling.factor == 8.0 and new.rope_theta == 500000.0


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json in .*Hugging Face model dir"):
        LlamaConfig.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, r"'gpt2'.*'llama'"),
        ({"architectures": ["LlamaForSequenceClassification"]}, r"ForSequenceClass.*ForCausalLM"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'.*'silu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type 'yarn'.*llama3"),
        ({"num_key_value_heads": 5}, r"num_attention_heads 32 .* num_key_value_heads 5"),
        ({"num_hidden_layers": 0}, r"`num_hidden_layers` .* positive integer; got 0"),
    ],
)
def test_unsupported_configs_name_the_value(change: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        LlamaConfig.from_dict({**BASE, **change})


def test_bert_directory_is_rejected_by_name(tmp_path: Path) -> None:
    from tests.utils.models import minilm_dir

    raw = json.loads((minilm_dir() / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"model_type 'bert'.*BertModel.*not supported"):
        LlamaConfig.from_dir(tmp_path)
