"""`z train`'s GPT as pipeline layers (a `zcore.pipe.PipelineModule`), each cut over `tp`.

The layers, in order, for a GPT of `n` blocks (`ztrain.gpt.GPT`'s modules, one per layer)::

    0          TiedLayerSpec("wte", TokenEmbedding)   ids (B, T) -> (B, T, C)
    1          LayerSpec(PositionEmbedding)           + wpe[:T]
    2 .. n+1   LayerSpec(PipeBlock)                   the transformer blocks
    n+2        LayerSpec(nn.LayerNorm)                ln_f
    n+3        the head: the tied `wte` read by `tied_logits` (tie_weights), else LMHead

and the loss `VocabParallelLoss`. Each layer says how it is cut over `tp` (`tp_cut`,
`tp_problems`: the `pipe` plan of `zcore.pipe.tensor`): the token embedding is
vocabulary-parallel (the tied head reads the same vocabulary slice, so the loss never holds
all the logits), each block is Megatron's (`zcore.tensor.gpt_plan.cut_block`), an untied
head is column-parallel; position embeddings and LayerNorms stay whole on every `tp` rank.

Weights start as `GPT(config, seed)`'s (`build_pipe_gpt` copies them by name), so a
pipelined run starts where the plain one does, and checkpoints key every parameter by its
`GPT` name (`PipeGPT.checkpoint_names`), so a checkpoint of either loads into the other at
any layout and consolidates to a `GPT` state dict; `as_gpt_state` renames the state of a
checkpoint written under the pipeline's own names.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from zcore.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from ztrain.gpt import GPT, Block, GPTConfig


def _divides(what: str, size: int, tp: int, fix: str) -> list[str]:
    if size % tp:
        return [f"{what} {size} is not divisible by tp {tp} ({size} % {tp} = {size % tp}); {fix}"]
    return []


class TokenEmbedding(nn.Embedding):
    """`wte`: token ids (B, T) -> (B, T, C); vocabulary-parallel under `tp`."""

    def tp_problems(self, tp: int) -> list[str]:
        return _divides(
            "vocab_size", self.num_embeddings, tp, "choose a `--vocab-size` divisible by tp"
        )

    def tp_cut(self, comm: Any) -> nn.Module:
        from zcore.tensor import VocabParallelEmbedding

        return VocabParallelEmbedding.from_embedding(self, comm, "wte")


class PositionEmbedding(nn.Embedding):
    """`wpe`: (B, T, C) -> the same plus the first T position embeddings."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x + super().forward(torch.arange(x.shape[1], device=x.device))


class PipeBlock(Block):
    """A `ztrain.gpt.Block`, cut as Megatron's under `tp` (heads and MLP columns)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.n_head, self.dropout = config.n_head, config.dropout

    def tp_problems(self, tp: int) -> list[str]:
        out = _divides("n_head", self.n_head, tp, "choose a `--tp` that divides the heads")
        if self.dropout and tp > 1:
            out.append(f"dropout {self.dropout}: tensor-parallel blocks take no dropout")
        return out

    def tp_cut(self, comm: Any) -> None:
        from zcore.tensor.gpt_plan import cut_block

        cut_block(self, comm, "block")


class LMHead(nn.Linear):
    """An untied output head (B, T, C) -> (B, T, V); column-parallel over `V` under `tp`."""

    def tp_problems(self, tp: int) -> list[str]:
        return _divides(
            "vocab_size", self.out_features, tp, "choose a `--vocab-size` divisible by tp"
        )

    def tp_cut(self, comm: Any) -> nn.Module:
        from zcore.tensor import ColumnParallelLinear

        return ColumnParallelLinear.from_linear(self, comm, name="lm_head")


def pipe_layers(config: GPTConfig) -> list[Any]:
    """The layer specs of `config`'s GPT (module docstring)."""
    from zcore.tensor.vocab import tied_logits

    c, v = config.n_embd, config.vocab_size
    layers: list[Any] = [
        TiedLayerSpec("wte", TokenEmbedding, v, c),
        LayerSpec(PositionEmbedding, config.block_size, c),
        *[LayerSpec(PipeBlock, config) for _ in range(config.n_layer)],
        LayerSpec(nn.LayerNorm, c, bias=config.bias),
    ]
    if config.tie_weights:
        layers.append(TiedLayerSpec("wte", TokenEmbedding, v, c, forward_fn=tied_logits))
    else:
        layers.append(LayerSpec(LMHead, c, v, bias=False))
    return layers


def gpt_name(name: str, n_layer: int) -> str:
    """A `PipelineModule` parameter name as `GPT` names it (`layers.3.attn...` ->
    `transformer.h.1.attn...`)."""
    if name.startswith("tied.wte."):
        return "transformer.wte." + name.removeprefix("tied.wte.")
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None:
        raise KeyError(f"{name!r} is not a parameter of the pipelined GPT")
    idx, rest = int(m.group(1)), m.group(2)
    if idx == 1:
        return f"transformer.wpe.{rest}"
    if 2 <= idx < n_layer + 2:
        return f"transformer.h.{idx - 2}.{rest}"
    if idx == n_layer + 2:
        return f"transformer.ln_f.{rest}"
    if idx == n_layer + 3:
        return f"lm_head.{rest}"
    raise KeyError(f"{name!r} is not a parameter of a GPT of {n_layer} blocks")


def gpt_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A pipelined GPT's full state dict (`zcore.checkpoint.consolidate`) in `GPT`'s names
    (the tied head as `lm_head.weight` too)."""
    out = {gpt_name(k, config.n_layer): v for k, v in state.items()}
    if config.tie_weights:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def as_gpt_state(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """`state` in `GPT`'s names: renamed when it is in a pipelined GPT's own names, and
    with the tied head's second name (a pipelined checkpoint has the embedding only);
    else unchanged."""
    if not isinstance(config, GPTConfig):
        return state
    if any(k.startswith(("tied.", "layers.")) for k in state):
        return gpt_state_dict(state, config)
    if config.tie_weights and "lm_head.weight" not in state and "transformer.wte.weight" in state:
        return {**state, "lm_head.weight": state["transformer.wte.weight"]}
    return state


class PipeGPT(PipelineModule):
    """A `PipelineModule` of `pipe_layers(config)` whose checkpoints use `GPT`'s names."""

    config: GPTConfig

    def checkpoint_names(self) -> dict[str, str]:
        """Every parameter of every stage (not only this rank's) -> its `GPT` name."""
        names = {}
        for idx, spec in enumerate(self.specs):
            prefix = f"tied.{spec.key}." if isinstance(spec, TiedLayerSpec) else f"layers.{idx}."
            for n, _ in spec.build_meta().named_parameters():
                names[prefix + n] = gpt_name(prefix + n, self.config.n_layer)
        return names


def build_pipe_gpt(
    config: GPTConfig, stages: int, seed: int = 0, schedule: str = "1f1b", **kw: Any
) -> Any:
    """`config`'s GPT cut into `stages` pipeline stages for `schedule` (`interleaved_1f1b`:
    two stages per rank in a loop; `zbv`: two in a V), starting from `GPT(config, seed)`'s
    weights. `kw` go to `PipelineModule` (e.g. `activation_checkpoint_interval`)."""
    from zcore.tensor.vocab import VocabParallelLoss

    layout = {
        "interleaved_1f1b": {"virtual_stages": 2},
        "zbv": {"virtual_stages": 2, "stage_order": "v"},
    }.get(schedule, {})
    model = PipeGPT(
        pipe_layers(config), num_stages=stages, loss_fn=VocabParallelLoss(), **layout, **kw
    )
    model.config = config  # what the run trains: `num_params`, the names, the export
    full = GPT(config, seed=seed).state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full[gpt_name(name, config.n_layer)])
    return model
