"""`redundancy_clean`: turn pruning masks into physically smaller layers.

A row-pruned layer loses its pruned output rows (and bias entries) and its *consumers* lose
the matching input columns (BERT `intermediate.dense` -> `output.dense`; LLaMA `up_proj` ->
`down_proj`, with `gate_proj` losing the same rows). A channel-pruned layer loses input
columns and its *producers* the matching rows. A head-pruned output projection loses the
heads' columns; q/k/v lose the heads' rows and the attention module's head count is updated.
Unstructured and N:M masks are folded into the weights (no shape change).

Because a pruned row outputs exactly 0 (its bias is masked too) and the activations used here
map 0 to 0 (GELU, ReLU, SiLU, and a gated product), the cleaned model computes the same
outputs as the masked one.

Related layers are named relative to an ancestor of the pruned layer (`output.dense` next to
`encoder.layer.3.intermediate.dense` resolves to `encoder.layer.3.output.dense`); they are
inferred for BERT/LLaMA/OPT-style names, or set explicitly on `PruneMask.related`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from zquant.pruning import BiasRowMask, PruneMask, masks_of

# (suffix of the pruned layer, peers sharing its rows, consumers of its rows) for row pruning.
_ROW_RULES = {
    "intermediate.dense": ([], ["output.dense"]),
    "mlp.up_proj": (["mlp.gate_proj"], ["mlp.down_proj"]),
    "mlp.gate_proj": (["mlp.up_proj"], ["mlp.down_proj"]),
    "fc1": ([], ["fc2"]),
}
# (suffix of the channel-pruned layer, producers of its input channels).
_CHANNEL_RULES = {
    "output.dense": ["intermediate.dense"],
    "mlp.down_proj": ["mlp.up_proj", "mlp.gate_proj"],
    "fc2": ["fc1"],
}
# (suffix of the output projection, q/k/v projections, attention module holding the head count).
_HEAD_RULES = {
    "attention.output.dense": (
        ["attention.self.query", "attention.self.key", "attention.self.value"],
        "attention.self",
    ),
    "self_attn.o_proj": (
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "self_attn",
    ),
}


def resolve_related(names: set[str], pruned: str, relative: str) -> str:
    """The module `relative` names for the pruned layer `pruned`.

    First as a name relative to the closest ancestor of `pruned` (`output.dense` next to
    `encoder.layer.3.intermediate.dense` is `encoder.layer.3.output.dense`); else as a regex
    (DeepSpeed's `related_modules`, e.g. `layer.\\w+.output.dense`), taking the match that
    shares the most leading name parts with `pruned` (the same layer).
    """
    parts = pruned.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        candidate = ".".join([*parts[:cut], relative])
        if candidate in names and candidate != pruned:
            return candidate
    try:
        pattern = re.compile(relative)
    except re.error as exc:
        raise ValueError(
            f"related module pattern {relative!r} is not a valid regex: {exc}"
        ) from exc

    def shared(name: str) -> int:
        n = 0
        for a, b in zip(name.split("."), parts, strict=False):
            if a != b:
                break
            n += 1
        return n

    matches = [n for n in names if n != pruned and pattern.search(n)]
    if matches:
        best = max(shared(n) for n in matches)
        top = sorted(n for n in matches if shared(n) == best)
        if len(top) == 1:
            return top[0]
        raise ValueError(
            f"related module {relative!r} of {pruned!r} is ambiguous: {top}; name it more precisely"
        )
    raise ValueError(
        f"related module {relative!r} of {pruned!r} matches no module; give its name relative "
        "to a common parent (e.g. 'output.dense') or a regex (e.g. 'layer.\\w+.output.dense')"
    )


def _rule(name: str, rules: dict) -> tuple[str, object] | None:
    for suffix, value in rules.items():
        if name == suffix or name.endswith("." + suffix):
            return suffix, value
    return None


@dataclass
class _Cut:
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    sources: list[str] = field(default_factory=list)


def _set(plan: dict[str, _Cut], name: str, dim: str, idx: torch.Tensor, source: str) -> None:
    cut = plan.setdefault(name, _Cut())
    old = getattr(cut, dim)
    if old is not None and not torch.equal(old, idx):
        raise ValueError(
            f"redundancy_clean: {name!r} would lose different {dim} for {cut.sources} and "
            f"{source!r}; prune only one layer of each linked group (e.g. up_proj or gate_proj)"
        )
    setattr(cut, dim, idx)
    cut.sources.append(source)


def _plan(model: nn.Module) -> tuple[dict[str, _Cut], dict[str, int]]:
    modules = dict(model.named_modules())
    names = set(modules)
    plan: dict[str, _Cut] = {}
    heads: dict[str, int] = {}  # attention module name -> kept query heads
    for name, mask in ((n, k) for n, m in modules.items() for k in masks_of(m)):
        if not mask.enabled or mask.kind in ("sparse", "nm"):
            continue
        kept = mask.kept()
        if mask.kind == "row":
            _set(plan, name, "rows", kept, name)
            rule = _rule(name, _ROW_RULES)
            peers, consumers = rule[1] if rule else ([], [])  # type: ignore[misc]
            if mask.related:
                peers, consumers = [], mask.related
            if not consumers:
                raise ValueError(
                    f"row-pruned {name!r}: no consumer layer known whose input columns shrink "
                    "with its rows; set `related_modules` (e.g. ['output.dense'])"
                )
            for peer in peers:
                _set(plan, resolve_related(names, name, peer), "rows", kept, name)
            for consumer in consumers:
                _set(plan, resolve_related(names, name, consumer), "cols", kept, name)
        elif mask.kind == "channel":
            _set(plan, name, "cols", kept, name)
            rule = _rule(name, _CHANNEL_RULES)
            producers = mask.related or (rule[1] if rule else [])
            if not producers:
                raise ValueError(
                    f"channel-pruned {name!r}: no producer layer known whose rows shrink with "
                    "its input channels; set `related_modules` (e.g. ['intermediate.dense'])"
                )
            for producer in producers:  # type: ignore[union-attr]
                _set(plan, resolve_related(names, name, producer), "rows", kept, name)
        elif mask.kind == "head":
            head_dim = mask.weight_shape[1] // mask.num_heads
            cols = (kept[:, None] * head_dim + torch.arange(head_dim)).flatten()
            _set(plan, name, "cols", cols, name)
            rule = _rule(name, _HEAD_RULES)
            qkv, attn = rule[1] if rule else (mask.related, None)  # type: ignore[misc]
            if mask.related:
                qkv = mask.related
            if not qkv:
                raise ValueError(
                    f"head-pruned {name!r}: q/k/v projections unknown; set `related_modules` "
                    "(e.g. ['self.query', 'self.key', 'self.value'])"
                )
            qkv_names = [resolve_related(names, name, r) for r in qkv]
            gqa = mask.num_kv_heads != mask.num_heads
            for i, proj in enumerate(qkv_names):
                # With GQA every KV group keeps the same number of query heads, so k/v stay.
                if gqa and i > 0:
                    continue
                _set(plan, proj, "rows", cols, name)
            attn_name = (
                resolve_related(names, name, attn) if attn else qkv_names[0].rsplit(".", 1)[0]
            )
            heads[attn_name] = len(kept) // (mask.num_kv_heads if gqa else 1)
            if gqa:
                heads[attn_name] = -heads[attn_name]  # negative: kept heads per KV group
    return plan, heads


def _effective(module: nn.Module, tensor: str) -> tuple[torch.Tensor, list[nn.Module]]:
    """(tensor with pruning masks applied, the other parametrizations to put back)."""
    if not parametrize.is_parametrized(module, tensor):
        return getattr(module, tensor).detach(), []
    chain = module.parametrizations[tensor]
    value = chain.original.detach()
    others = []
    for p in chain:
        if isinstance(p, (PruneMask, BiasRowMask)):
            value = p(value).detach()
        else:
            others.append(p)
    parametrize.remove_parametrizations(module, tensor, leave_parametrized=False)
    return value, others


def _apply(module: nn.Module, name: str, cut: _Cut) -> None:
    if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        raise TypeError(f"redundancy_clean: {name!r} is {type(module).__name__}, not Linear/ConvNd")
    has_bias = getattr(module, "bias", None) is not None
    bias, bias_others = _effective(module, "bias") if has_bias else (None, [])
    weight, others = _effective(module, "weight")
    if cut.rows is not None:
        weight = weight[cut.rows]
        bias = bias[cut.rows] if bias is not None else None
    if cut.cols is not None:
        weight = weight[:, cut.cols]
    module.weight = nn.Parameter(weight.contiguous())
    if bias is not None:
        module.bias = nn.Parameter(bias.contiguous())
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = weight.shape[0], weight.shape[1]
    else:
        module.out_channels, module.in_channels = weight.shape[0], weight.shape[1] * module.groups
    for p in others:
        parametrize.register_parametrization(module, "weight", p, unsafe=True)
    for p in bias_others:
        parametrize.register_parametrization(module, "bias", p, unsafe=True)


def _set_heads(attn: nn.Module, kept: int) -> None:
    if kept < 0:  # GQA: query heads per KV group
        attn.num_key_value_groups = -kept
        if hasattr(attn, "num_heads") and hasattr(attn, "num_key_value_heads"):
            attn.num_heads = -kept * attn.num_key_value_heads
        return
    for attr in ("num_attention_heads", "num_heads"):
        if hasattr(attn, attr):
            setattr(attn, attr, kept)
    if hasattr(attn, "all_head_size") and hasattr(attn, "attention_head_size"):
        attn.all_head_size = kept * attn.attention_head_size


@torch.no_grad()
def redundancy_clean(model: nn.Module) -> nn.Module:
    """Physically remove pruned rows, channels and heads (in place); returns `model`.

    Every enabled pruning mask is folded in: structured ones shrink their layer and its
    related layers, unstructured/N:M ones zero the weights in place. Other parametrizations
    (e.g. fake quantization) are kept.
    """
    plan, heads = _plan(model)
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if name in plan:
            _apply(module, name, plan[name])
        elif masks_of(module):
            _apply(module, name, _Cut())
    for name, kept in heads.items():
        _set_heads(modules[name], kept)
    return model


def count_parameters(model: nn.Module) -> int:
    """Parameters of the model as it computes (pruning scores and other masks' state excluded)."""
    total = 0
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if isinstance(module, PruneMask) and pname == "scores":
                continue
            total += p.numel()
    return total
