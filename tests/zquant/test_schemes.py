"""Recipes resolve against real models (MiniLM, SmolLM2 names) and reject bad input with the
layer, the shape and the fix in the message."""

from __future__ import annotations

import pytest
from torch import nn

from tests.zquant.quant_utils import minilm
from zquant.quantizers import QuantSpec
from zquant.schemes import (
    HEAD_ACT_OUTLIERS,
    MLP_PATTERN,
    LayerRule,
    Recipe,
    get_recipe,
    pattern_matches,
)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return minilm()


def test_w4a8_puts_int4_in_the_mlp_and_int8_in_attention(model):
    plans = {p.name: p for p in get_recipe("w4a8").plan(model)}
    assert len(plans) == 36  # 6 layers x (q, k, v, attn out, intermediate, output); no pooler
    assert "pooler.dense" not in plans
    for i in range(6):
        for name in ("intermediate.dense", "output.dense"):
            plan = plans[f"encoder.layer.{i}.{name}"]
            assert (plan.weight.bits, plan.weight.group_size, plan.act_bits) == (4, 32, 8)
        for name in ("attention.self.query", "attention.self.value", "attention.output.dense"):
            plan = plans[f"encoder.layer.{i}.{name}"]
            assert (plan.weight.bits, plan.weight.granularity, plan.act_bits) == (8, "channel", 8)


def test_mlp_pattern_covers_llama_and_bert_but_not_attention():
    for name in ("model.layers.3.mlp.down_proj", "encoder.layer.0.output.dense"):
        assert pattern_matches(MLP_PATTERN, name)
    for name in ("model.layers.3.self_attn.o_proj", "encoder.layer.0.attention.output.dense"):
        assert not pattern_matches(MLP_PATTERN, name)


def test_named_recipes_and_group_size(model):
    specs = {n: get_recipe(n).weight for n in ("w8a8", "w6a16", "w8", "w4", "xtc")}
    assert specs["w6a16"].fmt == "fp6" and specs["w8"].bits == 8
    assert (specs["w4"].bits, specs["w4"].group_size) == (4, 32)
    assert specs["xtc"].fmt == "binary" and get_recipe("xtc").method == "xtc"
    assert get_recipe("w4", group_size=100).weight.group_size == 100
    assert get_recipe("w8a8").act_bits == 8 and get_recipe("w6a16").act_bits is None


def test_overrides_skip_and_last_rule_wins(model):
    recipe = get_recipe(
        "w8",
        overrides=(
            LayerRule("*.intermediate.dense", QuantSpec(4, granularity="group", group_size=64)),
            LayerRule("re:encoder\\.layer\\.0\\.intermediate\\.dense", QuantSpec(6, "fp6")),
        ),
        skip=("encoder.layer.5.*",),
    )
    plans = {p.name: p for p in recipe.plan(model)}
    assert plans["encoder.layer.0.intermediate.dense"].weight.fmt == "fp6"
    assert plans["encoder.layer.1.intermediate.dense"].weight.bits == 4
    assert not any(n.startswith("encoder.layer.5.") for n in plans)
    assert len(plans) == 30


def test_recipe_round_trips_through_json(model):
    recipe = get_recipe("w4a8", group_size=128, skip=("*.query",))
    again = Recipe.from_dict(recipe.to_dict())
    assert again == recipe
    assert again.plan(model) == recipe.plan(model)


def test_unknown_recipe_and_method_are_rejected():
    with pytest.raises(ValueError, match=r"unknown recipe 'w3'.*w8a8, w4a8, w6a16, w8, w4, xtc"):
        get_recipe("w3")
    with pytest.raises(ValueError, match=r"unknown method 'gptq'.*'ptq' or 'xtc'"):
        Recipe("mine", QuantSpec(8), method="gptq")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['bitz'\]"):
        Recipe.from_dict({"weight": {"bits": 8}, "bitz": 4})


@pytest.mark.parametrize("bits", [0, 1, 17])
def test_bits_out_of_range_name_the_value_and_the_fix(bits):
    with pytest.raises(
        ValueError, match=rf"bits={bits} is out of range for fmt='int'; use 2\.\.16"
    ):
        Recipe("mine", QuantSpec(bits))
    with pytest.raises(ValueError, match=r"act_bits=16 is out of range; use 2\.\.8"):
        Recipe("mine", QuantSpec(8), act_bits=16)


@pytest.mark.parametrize("group_size", [0, -32])
def test_group_size_must_be_positive(group_size):
    with pytest.raises(ValueError, match=rf"group_size={group_size} must be a positive integer"):
        get_recipe("w4", group_size=group_size)
    with pytest.raises(ValueError, match=rf"group_size={group_size}.*positive int; set e\.g\."):
        Recipe("mine", QuantSpec(4, granularity="group", group_size=group_size))


def test_a_pattern_that_matches_nothing_names_it_and_some_layers(model):
    recipe = get_recipe("w8", skip=("*.mlp.*",))
    with pytest.raises(ValueError) as info:
        recipe.plan(model)
    message = str(info.value)
    assert "pattern '*.mlp.*' matches none of the 37 linear layers" in message
    assert "encoder.layer.0.attention.self.query (384, 384)" in message  # a layer and its shape
    assert "fix the pattern" in message
    override = LayerRule("re:.*\\.fc1", QuantSpec(4, granularity="group", group_size=32))
    with pytest.raises(ValueError, match=r"pattern 're:\.\*\\\\\.fc1' matches none"):
        get_recipe("w4", overrides=(override,)).plan(model)
    with pytest.raises(ValueError, match=r"not a valid regular expression"):
        get_recipe("w4", skip=("re:(",))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_a_spec_that_cannot_apply_names_the_layer_and_shape():
    # A 1-D "weight" cannot be grouped: the layer and its shape are in the message.
    recipe = Recipe("mine", QuantSpec(4, granularity="group", group_size=32))
    model = nn.Sequential(nn.Linear(8, 0))
    with pytest.raises(ValueError, match=r"layer '0' \(weight shape \(0, 8\)\).*non-empty 2-D"):
        recipe.plan(model)


def test_the_old_module_name_still_imports_with_a_deprecation_warning():
    import zquant.recipes

    with pytest.warns(DeprecationWarning, match=r"import `get_recipe` from `zquant\.schemes`"):
        from zquant.recipes import get_recipe as old

    assert old is get_recipe
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        zquant.recipes.nothing  # noqa: B018


def _tiny_lm() -> nn.Module:
    """A causal LM's layer names: `model.layers.0.mlp.up_proj` and a tied `lm_head`."""
    lm = nn.ModuleDict(
        {
            "model": nn.ModuleDict(
                {
                    "layers": nn.ModuleList(
                        [nn.ModuleDict({"mlp": nn.ModuleDict({"up_proj": nn.Linear(64, 32)})})]
                    )
                }
            ),
            "lm_head": nn.Linear(64, 100, bias=False),
        }
    )
    return lm


def test_lm_head_int8_quantizes_the_head_as_w8a8_and_round_trips():
    lm = _tiny_lm()
    assert [p.name for p in get_recipe("w4").plan(lm)] == ["model.layers.0.mlp.up_proj"]
    recipe = get_recipe("w4", lm_head="int8")
    plans = {p.name: p for p in recipe.plan(lm)}
    head = plans["lm_head"]
    assert (head.weight.bits, head.weight.granularity, head.weight.symmetric) == (
        8,
        "channel",
        True,
    )
    assert (head.act_bits, head.act_outliers, head.shape) == (8, HEAD_ACT_OUTLIERS, (100, 64))
    assert plans["model.layers.0.mlp.up_proj"].weight.bits == 4  # the rest as the recipe says
    again = Recipe.from_dict(recipe.to_dict())
    assert again == recipe and again.lm_head == "int8"
    old = recipe.to_dict()
    del old["lm_head"]  # a manifest written before the key existed
    assert Recipe.from_dict(old).lm_head is None


def test_lm_head_values_and_models_without_a_head_are_named(model):
    with pytest.raises(ValueError, match=r"lm_head='int4' is not supported; use 'int8'"):
        get_recipe("w4", lm_head="int4")
    with pytest.raises(ValueError, match=r"lm_head='fp8' is not supported"):
        Recipe.from_dict({"weight": {"bits": 8}, "lm_head": "fp8"})
    with pytest.raises(ValueError, match=r"lm_head='int8', but the model has no unskipped"):
        get_recipe("w8a8", lm_head="int8").plan(model)  # MiniLM: an encoder
    with pytest.raises(ValueError, match=r"the head is in `skip`"):
        get_recipe("w8a8", lm_head="int8", skip=("lm_head",)).plan(_tiny_lm())


def test_z_quantize_names_a_bad_lm_head(tmp_path):
    from tests.utils.cli import run_z
    from tests.utils.models import smollm2_dir

    args = ["quantize", str(smollm2_dir()), "--recipe", "w4", "--out", str(tmp_path / "q")]
    done = run_z(*args, "--lm-head", "int4", ok=False)
    assert done.returncode == 2 and not (tmp_path / "q").exists()
    assert "lm_head='int4' is not supported; use 'int8'" in done.stderr
