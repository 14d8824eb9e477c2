"""The optimizer registry: a type registered with its params model is validated by that model
(unknown keys get did-you-mean), matched ignoring case, and carries its flags; unknown types
list the registered ones."""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.zcore.config.common import load_error
from zcore.config import (
    OptimizerSpec,
    ZConfig,
    optim_registry,
    optimizer_spec,
    optimizer_types,
    register_optimizer,
    unregister_optimizer,
)


class SignParams(BaseModel):
    """A plug-in's params model: plain pydantic, not a zcore class."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(0.01, gt=0)
    momentum_beta: float = 0.0


def _build(groups: list[dict[str, Any]], params: SignParams) -> Any:
    raise AssertionError("not built in config tests")


SIGN = OptimizerSpec("SignSGD", SignParams, _build, reduces_own_gradients=True)


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test registers into a copy of the registry."""
    monkeypatch.setattr(optim_registry, "_specs", dict(optim_registry._specs))


def test_a_registered_type_is_validated_by_its_model() -> None:
    register_optimizer(SIGN)
    cfg = ZConfig.load({"optimizer": {"type": "signsgd", "params": {"lr": 0.5}}})
    assert cfg.optimizer is not None
    assert cfg.optimizer.type == "SignSGD"
    assert cfg.optimizer.params == SignParams(lr=0.5)
    assert cfg.optimizer.reduces_own_gradients is True
    assert cfg.optimizer.decoupled_weight_decay is None
    assert cfg.optimizer.spec is SIGN
    assert ZConfig.load(cfg.to_dict()) == cfg


def test_plugin_params_typo_gets_did_you_mean() -> None:
    register_optimizer(SIGN)
    error = load_error({"optimizer": {"type": "SignSGD", "params": {"momentum_bta": 0.9}}})
    (problem,) = error.problems
    assert (
        problem.message == "unknown key optimizer.params.momentum_bta; did you mean momentum_beta?"
    )


def test_plugin_params_values_are_checked_by_its_model() -> None:
    register_optimizer(SIGN)
    error = load_error({"optimizer": {"type": "SignSGD", "params": {"lr": 0}}})
    (problem,) = error.problems
    assert problem.path == "optimizer.params.lr"
    assert problem.message == "optimizer.params.lr = 0: must be > 0.0 (default 0.01)"


def test_unknown_type_lists_registered_ones() -> None:
    register_optimizer(SIGN)
    error = load_error({"optimizer": {"type": "SignSDG"}})
    (problem,) = error.problems
    assert problem.path == "optimizer.type"
    assert "did you mean SignSGD?" in problem.message
    registered = problem.message.split("(registered: ", 1)[1].split(";", 1)[0].split(", ")
    assert {"Adagrad", "Adam", "AdamW", "Lion", "SGD", "SignSGD"} <= set(registered)
    assert set(optimizer_types()) >= {"Adam", "AdamW", "SGD", "Adagrad", "Lion", "SignSGD"}


def test_builtins_are_specs_like_any_other() -> None:
    adam = optimizer_spec("ADAM")
    assert (adam.name, adam.params.__name__, adam.reduces_own_gradients) == (
        "Adam",
        "AdamParams",
        False,
    )
    from zcore.optim.factory import build_adam

    assert adam.factory() is build_adam


def test_registering_a_name_twice_needs_replace() -> None:
    register_optimizer(SIGN)
    register_optimizer(SIGN)  # the same spec again is harmless
    other = OptimizerSpec("signsgd", SignParams, _build)
    with pytest.raises(ValueError, match=r"already registered.*replace=True"):
        register_optimizer(other)
    register_optimizer(other, replace=True)
    assert optimizer_spec("SignSGD") is other
    unregister_optimizer("SIGNSGD")
    assert "signsgd" not in {t.lower() for t in optimizer_types()}


def test_spec_checks_what_it_is_given() -> None:
    with pytest.raises(TypeError, match="params must be a pydantic model class"):
        OptimizerSpec("X", dict, _build)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="build must be a callable or 'module:function'"):
        OptimizerSpec("X", SignParams, "no_colon")
    with pytest.raises(ValueError, match="must be an identifier"):
        OptimizerSpec("two words", SignParams, _build)


def test_old_optim_factory_module_warns_and_still_works() -> None:
    sys.modules.pop("zcore.optim_factory", None)
    with pytest.warns(DeprecationWarning, match=r"zcore\.optim\.factory"):
        old = importlib.import_module("zcore.optim_factory")
    from zcore.optim.factory import build_inner_optimizer

    assert old.build_inner_optimizer is build_inner_optimizer
    sys.modules.pop("zcore.optim_factory", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.import_module("zcore.optim.factory")  # the new home is silent
