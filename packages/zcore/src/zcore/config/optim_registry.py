"""The optimizer registry: ``optimizer.type`` -> params model, factory and flags.

zcore registers its built-ins (Adam, AdamW, SGD, Adagrad, Lion) here at import; other
packages register theirs either by calling :func:`register_optimizer` or, so that
installing the package is enough, through a ``zcore.optimizers`` entry point::

    [project.entry-points."zcore.optimizers"]
    OneBitAdam = "zcomm.onebit:ONEBIT_ADAM"      # an OptimizerSpec

Types are matched ignoring case, as DeepSpeed does, and stored in the spelling the
spec gives. This module imports neither torch nor the factories: a factory may be
named as ``"module:function"`` and is imported when the engine builds the optimizer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from zcore.config import plugins
from zcore.config.errors import did_you_mean

#: ``build(param_groups, params) -> torch.optim.Optimizer``: ``param_groups`` are the
#: master-partition groups (``{"params": [flat fp32 tensor], ...}``), ``params`` the
#: validated instance of the spec's params model.
OptimizerFactory = Callable[[list[dict[str, Any]], Any], Any]


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer type: what its ``params`` block accepts and how to build it."""

    name: str
    """The ``type`` as it is spelled canonically (matched ignoring case)."""
    params: type[BaseModel]
    """The pydantic model that validates ``optimizer.params``; its instance goes to ``build``."""
    build: OptimizerFactory | str
    """The factory, or ``"module:function"`` naming it (imported at first build)."""
    reduces_own_gradients: bool = False
    """True when the optimizer communicates its gradients itself (1-bit Adam compresses
    them): zcore records the flag on :attr:`OptimizerConfig.reduces_own_gradients`."""
    decoupled_weight_decay: bool | Callable[[Any], bool] | None = None
    """Whether weight decay is decoupled (AdamW) or an L2 penalty, or a function of the
    params deciding it; None when it does not apply."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"OptimizerSpec name must be an identifier, got {self.name!r}")
        if not (isinstance(self.params, type) and issubclass(self.params, BaseModel)):
            raise TypeError(
                f"OptimizerSpec {self.name}: params must be a pydantic model class, "
                f"got {self.params!r}"
            )
        if not (callable(self.build) or (isinstance(self.build, str) and ":" in self.build)):
            raise TypeError(
                f"OptimizerSpec {self.name}: build must be a callable or 'module:function', "
                f"got {self.build!r}"
            )

    def factory(self) -> OptimizerFactory:
        """``build`` as a callable (imports it when given as ``"module:function"``)."""
        if callable(self.build):
            return self.build
        module, _, attr = self.build.partition(":")
        return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


_specs: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec, *, replace: bool = False) -> None:
    """Make ``optimizer.type = spec.name`` (any case) build ``spec``.

    Registering a second spec under a name already taken is an error unless
    ``replace`` (registering the same spec again is harmless).
    """
    if not isinstance(spec, OptimizerSpec):
        raise TypeError(f"register_optimizer takes an OptimizerSpec, got {type(spec).__name__}")
    key = spec.name.lower()
    old = _specs.get(key)
    if old is not None and old != spec and not replace:
        raise ValueError(
            f"optimizer type {spec.name!r} is already registered (as {old.name}, params "
            f"{old.params.__name__}); pass replace=True to override it"
        )
    _specs[key] = spec


def unregister_optimizer(name: str) -> None:
    """Forget the type ``name`` (tests, mostly); unknown names are ignored."""
    _specs.pop(name.lower(), None)


def optimizer_types() -> list[str]:
    """Every type a config may name: the registered ones and the installed entry points."""
    names = {spec.name.lower(): spec.name for spec in _specs.values()}
    for name in plugins.discover(plugins.OPTIMIZERS_GROUP):
        names.setdefault(name.lower(), name)
    return sorted(names.values(), key=str.lower)


class UnknownOptimizer(ValueError):
    """``optimizer.type`` names no registered type; the message lists them."""


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec registered for ``name`` (ignoring case), loading its entry point if an
    installed package declares it. :class:`UnknownOptimizer` lists the types there are."""
    spec = _specs.get(name.lower())
    if spec is not None:
        return spec
    ep = plugins.find(plugins.OPTIMIZERS_GROUP, name)
    if ep is None:
        known = optimizer_types()
        raise UnknownOptimizer(
            f"not a registered optimizer type{did_you_mean(name, known)} (registered: "
            f"{', '.join(known)}; a package adds one through a `{plugins.OPTIMIZERS_GROUP}` "
            "entry point)"
        )
    loaded = plugins.load(ep)
    spec = loaded if isinstance(loaded, OptimizerSpec) else _call(loaded, ep.value)
    if spec.name.lower() != ep.name.lower():
        raise plugins.PluginError(
            f"entry point `{ep.name} = {ep.value}` of group {ep.group} gives the optimizer "
            f"spec {spec.name!r}; the entry point's name must be the type"
        )
    register_optimizer(spec)
    return spec


def _call(factory: Any, where: str) -> OptimizerSpec:
    spec = factory() if callable(factory) else factory
    if not isinstance(spec, OptimizerSpec):
        raise plugins.PluginError(
            f"`{where}` must be an OptimizerSpec or a function returning one, "
            f"got {type(spec).__name__}"
        )
    return spec
