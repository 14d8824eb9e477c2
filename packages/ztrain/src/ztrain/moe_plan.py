"""The `--moe` flags of `z train` checked once, and the model a run builds from its plan.

`plan_moe` turns the flags into a `MoESpec` (or None: the GPT), raising TrainError with
the numbers involved; `model_config` makes the model's config once the tokenizer's
vocabulary is known; `config_from_dict` / `build_model` read a saved `model.json` of
either architecture (a GPT's has no `arch` key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ztrain.train_options import TrainError, TrainOptions

MOE_FLAGS = (
    "moe_experts",
    "moe_top_k",
    "moe_layers",
    "moe_capacity_factor",
    "moe_dropless",
    "moe_ep",
    "moe_aux_coef",
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class MoESpec:
    """The Mixtral-architecture model a run trains (`moe_lm.MoELMConfig` minus its sizes)."""

    layer_experts: tuple[int, ...]
    """Experts of each layer, 0 for a dense layer; all 0 for the dense twin."""
    k: int
    capacity_factor: float
    dropless: bool
    ep_size: int
    aux_loss_coef: float

    @property
    def dense_twin(self) -> bool:
        return not any(self.layer_experts)

    def describe(self) -> str:
        if self.dense_twin:
            return f"dense twin (SwiGLU of {self.k} x expert width)"
        counts = sorted(set(self.layer_experts) - {0})
        moe = sum(1 for e in self.layer_experts if e)
        route = "dropless" if self.dropless else f"capacity factor {self.capacity_factor:g}"
        return (
            f"{moe}/{len(self.layer_experts)} MoE layers of {'/'.join(map(str, counts))} experts, "
            f"top-{self.k}, {route}, ep {self.ep_size}, aux coef {self.aux_loss_coef:g}"
        )


def _parse_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise TrainError(
            f"`--moe-experts {text}` is not a count or comma-separated counts (e.g. `8` or `4,8`)"
        ) from None
    if any(c < 1 for c in counts):
        raise TrainError(f"`--moe-experts {text}`: every expert count must be at least 1")
    return counts


def plan_moe(opts: TrainOptions, world_size: int, n_layer: int) -> tuple[MoESpec | None, list[str]]:
    """The run's MoE model (None: the GPT) and notes to print; raises TrainError."""
    from ztrain.moe_lm import layer_experts

    given = [f for f in MOE_FLAGS if f in opts.explicit]
    if not (opts.moe or opts.dense_twin):
        if given:
            raise TrainError(
                f"`{_flag(given[0])}` describes an MoE model; add `--moe` (or `--dense-twin`)"
            )
        return None, []
    counts = _parse_counts(opts.moe_experts)
    k = opts.moe_top_k
    if k < 1 or k > min(counts):
        raise TrainError(
            f"`--moe-top-k {k}` must be between 1 and the fewest experts of a layer "
            f"({min(counts)} in `--moe-experts {opts.moe_experts}`)"
        )
    if opts.moe_capacity_factor <= 0:
        raise TrainError(f"`--moe-capacity-factor {opts.moe_capacity_factor}` must be positive")
    if opts.moe_dropless and "moe_capacity_factor" in opts.explicit:
        raise TrainError(
            f"`--moe-capacity-factor {opts.moe_capacity_factor}` has no effect with "
            "`--moe-dropless` (no token is dropped); pass one of them"
        )
    if opts.moe_aux_coef < 0:
        raise TrainError(f"`--moe-aux-coef {opts.moe_aux_coef}` must be 0 or more")
    try:
        layers = layer_experts(n_layer, opts.moe_layers, counts)
    except ValueError as err:
        raise TrainError(
            f"`--moe-layers {opts.moe_layers}`, `--moe-experts {opts.moe_experts}`: {err}"
        ) from None
    notes = []
    ep = opts.moe_ep
    if opts.dense_twin:
        if ep != 1:
            notes.append(f"`--moe-ep {ep}` is ignored: the dense twin has no experts")
        ep, layers = 1, tuple(0 for _ in layers)
    elif ep < 1 or world_size % ep:
        raise TrainError(
            f"`--moe-ep {ep}` must divide the {world_size} rank(s) of the job; "
            f"pass `--nproc` a multiple of {ep} or a smaller `--moe-ep`"
        )
    elif any(c % ep for c in counts):
        raise TrainError(
            f"`--moe-ep {ep}` must divide every layer's expert count "
            f"(`--moe-experts {opts.moe_experts}`)"
        )
    spec = MoESpec(
        layer_experts=layers,
        k=k,
        capacity_factor=opts.moe_capacity_factor,
        dropless=opts.moe_dropless,
        ep_size=ep,
        aux_loss_coef=opts.moe_aux_coef,
    )
    return spec, notes


def model_config(preset: str, vocab_size: int, moe: MoESpec | None) -> Any:
    """The `GPTConfig` of `preset`, or the `MoELMConfig` of `moe` at the preset's sizes."""
    from ztrain.gpt import PRESETS, GPTConfig
    from ztrain.moe_lm import MoELMConfig, swiglu_ffn

    if moe is None:
        return GPTConfig.preset(preset, vocab_size=vocab_size)
    p = PRESETS[preset]
    return MoELMConfig(
        vocab_size=vocab_size,
        n_layer=p["n_layer"],
        n_head=p["n_head"],
        n_embd=p["n_embd"],
        block_size=p["block_size"],
        expert_ffn=swiglu_ffn(p["n_embd"], moe.k),
        experts=moe.layer_experts,
        k=moe.k,
        capacity_factor=moe.capacity_factor,
        dropless=moe.dropless,
        ep_size=moe.ep_size,
        aux_loss_coef=moe.aux_loss_coef,
    )


def config_from_dict(fields: dict[str, Any], *, ep_size: int | None = None) -> Any:
    """A saved `model.json`: `MoELMConfig` when it says `arch: mixtral`, else `GPTConfig`.

    `ep_size` replaces the MoE model's (1 to load every expert into one process).
    """
    import dataclasses

    from ztrain.gpt import GPTConfig
    from ztrain.moe_lm import ARCH, MoELMConfig

    if fields.get("arch") == ARCH:
        config = MoELMConfig.from_dict(fields)
        return config if ep_size is None else dataclasses.replace(config, ep_size=ep_size)
    return GPTConfig.from_dict(fields)


def build_model(config: Any, seed: int = 0) -> Any:
    """A `GPT` or a `MoELM` for `config`."""
    from ztrain.gpt import GPT
    from ztrain.moe_lm import MoELM, MoELMConfig

    return MoELM(config, seed=seed) if isinstance(config, MoELMConfig) else GPT(config, seed=seed)


def model_name(config: Any, preset: str) -> str:
    """`GPT small`, `MoE small (...)`: what the run says it trains."""
    from ztrain.moe_lm import MoELMConfig

    if not isinstance(config, MoELMConfig):
        return f"GPT {preset}"
    kind = "dense twin" if config.is_dense else "MoE"
    active = config.num_params(active=True) / 1e6
    return f"Mixtral-style {kind} {preset} ({active:.1f}M active params)"


def drop_non_persistent(state: dict[str, Any], model: Any) -> dict[str, Any]:
    """`state` without `model`'s non-persistent buffers (the rotary tables, zmoe's unused
    `expert_bias`): zcore checkpoints written before 2026-11-25 hold every buffer, and
    `load_state_dict` expects none of these. Keyed by buffer name, so an ep rank's model
    filters a whole model's state."""
    drop = set(dict(model.named_buffers())) - set(model.state_dict())
    return {k: v for k, v in state.items() if k not in drop}
