"""Match a Hugging Face checkpoint's tensor names to a model's parameters and buffers.

The rules are transformers' own, stated here so a mismatch is an error that names the keys:
a name matches itself, or itself with or without the model's ``base_model_prefix`` (a
``BertModel`` checkpoint loads into ``BertForMaskedLM`` and the other way round); tied
parameters (``lm_head.weight`` ↔ ``model.embed_tokens.weight``) are one parameter and need
one of their names; a checkpoint tensor naming a non-persistent buffer (old BERT files carry
``embeddings.position_ids``) or matching the model's ``_keys_to_ignore_on_load_unexpected``
is skipped, since the model computes its own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from zcore.hf.safetensors_io import Entry


class CheckpointKeyError(ValueError):
    """The checkpoint and the model disagree on names or shapes; the message lists them."""


@dataclass
class KeyPlan:
    """Where each of the model's tensors comes from."""

    params: list[tuple[list[str], str]]
    """Each distinct parameter: all its names in the model (tied ones share), its checkpoint key."""
    buffers: list[tuple[str, str]]
    """Each persistent buffer: its name, its checkpoint key."""
    ignored: list[str]
    """Checkpoint keys deliberately not loaded."""


def patterns(model: nn.Module, attr: str) -> list[re.Pattern[str]]:
    """The regexes a transformers model lists in ``attr`` (e.g. ``_keys_to_ignore_on_save``)."""
    return [re.compile(p) for p in (getattr(model, attr, None) or [])]


def _variants(name: str, prefix: str) -> list[str]:
    out = [name]
    if prefix:
        if name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1 :])
        else:
            out.append(f"{prefix}.{name}")
    return out


def _show(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def plan_keys(model: nn.Module, entries: Mapping[str, Entry], strict: bool = True) -> KeyPlan:
    """Where each parameter and persistent buffer of ``model`` is in ``entries``; raises
    :class:`CheckpointKeyError` naming every missing key, shape mismatch and (``strict``)
    unexpected key."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    groups: dict[int, list[str]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
        shapes[id(p)] = tuple(p.shape)
    used: set[str] = set()
    missing: list[str] = []
    wrong: list[str] = []

    def find(names: list[str], shape: tuple[int, ...]) -> str | None:
        for name in names:
            for key in _variants(name, prefix):
                if key in entries:
                    used.add(key)
                    if entries[key].shape != shape:
                        wrong.append(
                            f"`{key}` is {list(entries[key].shape)} in the checkpoint, "
                            f"{list(shape)} in the model"
                        )
                    return key
        missing.append(names[0] if len(names) == 1 else f"{names[0]} (tied: {names[1:]})")
        return None

    params = []
    for pid, names in groups.items():
        key = find(names, shapes[pid])
        if key is not None:
            params.append((names, key))
    buffers, transient = [], set()
    for mname, module in model.named_modules():
        for leaf, buf in module.named_buffers(recurse=False):
            name = f"{mname}.{leaf}" if mname else leaf
            if buf is None or leaf in module._non_persistent_buffers_set:
                transient.update(_variants(name, prefix))
                continue
            key = find([name], tuple(buf.shape))
            if key is not None:
                buffers.append((name, key))
    skip = patterns(model, "_keys_to_ignore_on_load_unexpected")
    extra = [k for k in entries if k not in used]
    ignored = [k for k in extra if k in transient or any(p.search(k) for p in skip)]
    unexpected = [k for k in extra if k not in ignored]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {_show(missing)}")
    if wrong:
        problems.append(f"shape mismatch: {'; '.join(wrong[:8])}")
    if unexpected and strict:
        problems.append(f"in the checkpoint but not the model: {_show(unexpected)}")
    if problems:
        raise CheckpointKeyError(
            f"{type(model).__name__} does not match the checkpoint ({len(entries)} tensors; "
            f"model prefix {prefix!r}): " + " | ".join(problems) + ". Check that the model "
            "class and config fit this checkpoint (pass `strict=False` to skip tensors the "
            "model does not have)"
        )
    return KeyPlan(params, buffers, ignored + (unexpected if not strict else []))
