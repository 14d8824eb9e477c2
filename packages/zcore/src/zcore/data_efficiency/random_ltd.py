"""Random-LTD on a model's layer list: the chosen middle layers see a random subset of tokens.

:meth:`RandomLTD.attach` finds the model's transformer layers (``model.random_ltd_layers()``
when the model defines it, else ``transformer.h`` (z train's GPT), ``model.layers`` (HF
LLaMA/Mistral/Qwen), ``bert.encoder.layer`` / ``encoder.layer`` (HF BERT)), checks their
count against ``total_layer_num``, and replaces the ``forward`` of each layer named by
``random_ltd_layer_id`` with a routed one. The layers stay where they are: parameter names,
``state_dict`` keys and ZeRO stage-3 hooks do not change, and :meth:`RandomLTD.detach`
restores the original forwards.

A routed layer, in training and while the schedule keeps fewer tokens than the sequence has:

1. draws per sample ``keep`` distinct positions, sorted (:func:`token_routing.sample_indices`;
   each layer its own draw, from torch's generator on the hidden states' device);
2. gathers those tokens, and cuts what the layer reads per token to them: the attention
   mask named by ``model_mask_name`` (keys and queries), ``position_ids`` and HF's rotary
   ``position_embeddings`` (cos, sin), so rotary attention sees the kept tokens at their
   true positions and a causal mask keeps them causal among themselves;
3. runs the layer on the subset and scatters its output back; the dropped tokens pass the
   layer unchanged (their hidden state goes on to the next layer as it came in).

In eval, or once the schedule keeps the whole sequence, the layer runs as before, exactly.
A KV cache HF builds during a training forward (``use_cache`` defaults to true) holds only
the kept tokens of a routed layer: random-LTD is for training, not for generating from it.
The engine (:class:`zcore.engine.ZEngine`) attaches it from the config and calls
:meth:`RandomLTD.update` with ``global_steps`` before each training forward.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zcore.config.errors import ConfigError
from zcore.data_efficiency import token_routing as tr
from zcore.data_efficiency.random_ltd_config import RandomLTDConfig
from zcore.data_efficiency.random_ltd_schedule import RandomLTDScheduler

LAYER_PATHS = ("transformer.h", "model.layers", "bert.encoder.layer", "encoder.layer", "layers")
"""Where :func:`find_layers` looks for the layer list, in order."""


def find_layers(model: nn.Module) -> nn.ModuleList:
    """The model's transformer layers (see the module docstring)."""
    own = getattr(model, "random_ltd_layers", None)
    if callable(own):
        return own()
    for path in LAYER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(
        f"random-LTD found no layer list in {type(model).__name__} (looked at "
        f"{', '.join(LAYER_PATHS)}); give the model a `random_ltd_layers()` method returning "
        "its nn.ModuleList of transformer layers"
    )


class RandomLTD:
    """The random-LTD of one model: its schedule and its routed layers."""

    def __init__(self, config: RandomLTDConfig, layers: nn.ModuleList, global_batch_size: int):
        if not config.enabled:
            raise ValueError("RandomLTD needs an enabled random_ltd block")
        if len(layers) != config.total_layer_num:
            raise ConfigError.single(
                "data_efficiency.data_routing.random_ltd.total_layer_num",
                config.total_layer_num,
                f"the model has {len(layers)} layers; set it to {len(layers)} (and "
                f"random_ltd_layer_id within [1, {len(layers) - 2}])",
            )
        self.config = config
        self.scheduler = RandomLTDScheduler(config, global_batch_size)
        self.layers = layers
        self._originals: dict[int, Callable[..., Any]] = {}
        self._hook: Any = None
        old = getattr(layers, "_z_random_ltd", None)
        if old is not None:  # routed by an earlier engine: start from the plain layers
            old.detach()
        layers._z_random_ltd = self  # type: ignore[assignment]
        for layer_id in config.random_ltd_layer_id or []:
            self._route(layers[layer_id], layer_id)

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        config: RandomLTDConfig,
        global_batch_size: int,
        layers: nn.ModuleList | None = None,
    ) -> RandomLTD:
        """Route ``model``'s middle layers (``layers``: its layer list, found when None)."""
        return cls(config, find_layers(model) if layers is None else layers, global_batch_size)

    @classmethod
    def from_config(
        cls, zconfig: Any, model: nn.Module, global_batch_size: int
    ) -> RandomLTD | None:
        """From a loaded ``ZConfig``: None unless its random-LTD block is enabled."""
        from zcore.data_efficiency.config import parse_blocks

        block = parse_blocks(zconfig)[0].random_ltd
        return None if block is None else cls.attach(model, block, global_batch_size)

    def follow(self, engine: Any) -> None:
        """Update the schedule to ``engine.global_steps`` before each training forward of
        ``engine.module`` (a forward pre-hook holding the engine weakly)."""
        ref = weakref.ref(engine)

        def pre_hook(module: nn.Module, args: Any) -> None:
            live = ref()
            if live is not None and module.training:
                self.update(live.global_steps)

        self._hook = engine.module.register_forward_pre_hook(pre_hook)

    def update(self, step: int) -> int:
        """Tokens kept at optimizer step ``step`` (0-based), which the layers then use."""
        return self.scheduler.update(step)

    @property
    def keep(self) -> int:
        return self.scheduler.current

    def lr_scheduler(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> Any:
        """The LayerToken schedule when ``layer_token_lr_schedule`` is on (it replaces
        ``scheduler``); else ``scheduler``."""
        lt = self.config.layer_token_lr_schedule
        if not lt.enabled:
            return scheduler
        from zcore.lr_schedules.layer_token import LayerTokenLR

        assert lt.total_layer_tokens is not None
        return LayerTokenLR(
            optimizer,
            total_layer_tokens=lt.total_layer_tokens,
            warmup_layer_tokens=lt.warmup_layer_tokens,
            warmup_type=lt.warmup_type,
            layer_tokens=self.scheduler.layer_tokens_before,
        )

    def detach(self) -> None:
        """Give every routed layer its own forward back (and stop following an engine)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if getattr(self.layers, "_z_random_ltd", None) is self:
            del self.layers._z_random_ltd
        for layer_id, forward in self._originals.items():
            layer = self.layers[layer_id]
            if layer.__dict__.get("forward") is not None:
                del layer.forward
            assert layer.forward == forward
        self._originals.clear()

    # -- the routed forward -----------------------------------------------------------------
    def _route(self, layer: nn.Module, layer_id: int) -> None:
        original = layer.forward
        self._originals[layer_id] = original
        signature = inspect.signature(original)
        batch_first = self.config.hidden_state_order == "batch_seq_dim"
        mask_name = self.config.model_mask_name

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seq_dim = 1 if batch_first else 0
            T = hidden_states.shape[seq_dim]
            if not layer.training or self.keep >= T:
                return original(hidden_states, *args, **kwargs)
            bound = signature.bind(hidden_states, *args, **kwargs)
            named = dict(bound.arguments)
            extra = named.pop(_var_keyword(signature), None) or {}
            named.update(extra)
            x = hidden_states if batch_first else hidden_states.transpose(0, 1)  # (B, T, C)
            idx = tr.sample_indices(x.shape[0], T, self.keep, x.device)  # (B, K)
            part = tr.gather_tokens(x, idx)  # (B, K, C)
            first = next(iter(signature.parameters))
            named[first] = part if batch_first else part.transpose(0, 1).contiguous()
            if mask_name is not None and named.get(mask_name) is not None:
                named[mask_name] = tr.gather_mask(named[mask_name], idx, T)
            if isinstance(named.get("position_ids"), torch.Tensor):
                named["position_ids"] = tr.gather_positions(named["position_ids"], idx)
            pe = named.get("position_embeddings")
            if isinstance(pe, tuple):
                named["position_embeddings"] = tuple(tr.gather_positions(t, idx) for t in pe)
            out = original(**named)
            y = out[0] if isinstance(out, tuple) else out
            if not isinstance(y, torch.Tensor):
                raise TypeError(
                    f"random-LTD layer {layer_id} returned {type(out).__name__}; a routed "
                    "layer must return its hidden states (a tensor, or a tuple starting with one)"
                )
            y = y if batch_first else y.transpose(0, 1)
            merged = tr.scatter_tokens(x, y, idx)  # (B, T, C)
            merged = merged if batch_first else merged.transpose(0, 1)
            return (merged, *out[1:]) if isinstance(out, tuple) else merged

        layer.forward = forward  # type: ignore[method-assign]


def _var_keyword(signature: inspect.Signature) -> str | None:
    for p in signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return p.name
    return None
