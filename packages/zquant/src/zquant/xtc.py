"""XTC extreme compression (Wu et al. 2022, "Extreme Compression for Pre-trained Transformers
Made Simple and Efficient"): binary/ternary weights + layer reduction + one-stage distillation.

1. `reduce_layers`: the student keeps `keep_layers` of the teacher's n transformer layers,
   copied from the teacher (the paper's "lightweight layer reduction").
2. `apply_fake_quant`: every `nn.Linear` (and, by default, every `nn.Embedding`) weight is
   binarized (`sign(w) * mean|w|` per row) or ternarized (TWN per row) in the forward through a
   parametrization; the latent fp32 weights train through a straight-through gradient.
3. `xtc_compress`: one stage of knowledge distillation from the full-precision teacher
   (hidden-state MSE on mapped layers + pooled-embedding cosine + logits KL where present).
4. `export_packed`: fake-quant layers become packed `QuantLinear` / `QuantEmbedding` (1 bit per
   binary weight, 2 per ternary, one fp32 scale per row), `compressed_size` counts the bytes.

The paper distils with attention-map losses too; those need eager attention, so they are left
out here (hidden states carry most of the signal at this scale).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from zquant.distill import distill_loss, layer_map
from zquant.nn import QuantLinear
from zquant.quantizers import (
    QuantizedWeight,
    QuantSpec,
    dequantize_weight,
    fake_quantize,
    quantize_weight,
)


def xtc_spec(bits: int) -> QuantSpec:
    """The XTC weight format for `bits`: 1 = binary, 2 = ternary, one scale per row."""
    if bits == 1:
        return QuantSpec(1, "binary", granularity="channel")
    if bits == 2:
        return QuantSpec(2, "ternary", granularity="channel")
    raise ValueError(f"XTC bits must be 1 (binary) or 2 (ternary), got {bits}")


class WeightFakeQuant(nn.Module):
    """Parametrization `w -> fake_quantize(w, spec)` (straight-through gradient).

    A frozen latent weight (`requires_grad=False`, e.g. a big embedding table kept fixed) is
    quantized once and reused until it changes.
    """

    def __init__(self, spec: QuantSpec) -> None:
        super().__init__()
        self.spec = spec
        self._cache: tuple[tuple[int, int], Tensor] | None = None

    def forward(self, weight: Tensor) -> Tensor:
        if weight.requires_grad:
            return self._quantize(weight)
        key = (weight.data_ptr(), weight._version)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._quantize(weight))
        return self._cache[1]

    def _quantize(self, weight: Tensor) -> Tensor:
        return fake_quantize(weight, self.spec)


class QuantEmbedding(nn.Module):
    """An embedding table stored packed (one scale per token row); rows dequantized on lookup."""

    def __init__(self, weight: QuantizedWeight, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx
        for key, value in weight.to_state().items():
            self.register_buffer(key, value)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, spec: QuantSpec) -> QuantEmbedding:
        """Quantize `embedding.weight` (num_embeddings, dim) with `spec`."""
        return cls(quantize_weight(embedding.weight.detach(), spec), embedding.padding_idx)

    def quantized_weight(self) -> QuantizedWeight:
        keys = ("qmeta", "qdata", "qscale", "qzero", "qdata2")
        state = {k: getattr(self, k) for k in keys if hasattr(self, k)}
        return QuantizedWeight.from_state({k: v for k, v in state.items() if v is not None})

    def nbytes(self) -> int:
        """Stored bytes: packed codes plus scales."""
        return self.quantized_weight().nbytes()

    def forward(self, ids: Tensor) -> Tensor:
        # Dequantize only the rows looked up (a 30k-row table per call would dominate).
        qw = self.quantized_weight()
        uniq, inverse = torch.unique(ids.reshape(-1), return_inverse=True)

        def rows(t: Tensor | None) -> Tensor | None:
            return t if t is None or t.shape[0] == 1 else t[uniq]

        sub = QuantizedWeight(
            qw.spec,
            (len(uniq), self.embedding_dim),
            qw.data[uniq],
            rows(qw.scale),  # type: ignore[arg-type]
            rows(qw.zero),
            rows(qw.data2),
        )
        return dequantize_weight(sub)[inverse].view(*ids.shape, self.embedding_dim)


def find_layers(model: nn.Module, prefix: str | None = None) -> tuple[str, nn.ModuleList]:
    """(name, list) of the transformer layer stack: `prefix` if given, else the largest
    `nn.ModuleList` of same-typed blocks (`encoder.layer` in BERT, `model.layers` in LLaMA)."""
    if prefix is not None:
        try:
            found = model.get_submodule(prefix)
        except AttributeError as exc:
            raise ValueError(
                f"module_name_prefix {prefix!r} is not a module of {type(model).__name__}"
            ) from exc
        if not isinstance(found, nn.ModuleList):
            raise ValueError(
                f"module_name_prefix {prefix!r} is a {type(found).__name__}, not the ModuleList "
                "of layers (e.g. 'encoder.layer' or 'model.layers')"
            )
        return prefix, found
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            if len({type(m) for m in module}) == 1:
                size = sum(p.numel() for p in module.parameters())
                if best is None or size > best[0]:
                    best = (size, name, module)
    if best is None:
        raise ValueError(
            f"{type(model).__name__} has no ModuleList of layers; pass module_name_prefix"
        )
    return best[1], best[2]


def reduce_layers(
    teacher: nn.Module, keep_layers: Sequence[int], *, prefix: str | None = None
) -> nn.Module:
    """A copy of `teacher` keeping only layers `keep_layers` (ascending), copied from it."""
    name, layers = find_layers(teacher, prefix)
    keep = list(keep_layers)
    if not keep or sorted(set(keep)) != keep or keep[0] < 0 or keep[-1] >= len(layers):
        raise ValueError(
            f"keep_layers {keep} must be distinct ascending indices into the {len(layers)} "
            f"layers of {name!r}, e.g. {list(range(0, len(layers), 2))}"
        )
    student = copy.deepcopy(teacher)
    _, student_layers = find_layers(student, name)
    kept = nn.ModuleList([student_layers[i] for i in keep])
    parent, _, attr = name.rpartition(".")
    setattr(student.get_submodule(parent) if parent else student, attr, kept)
    for new_index, layer in enumerate(kept):
        for module in layer.modules():  # KV caches index layers by position
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new_index
    config = getattr(student, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):
        config.num_hidden_layers = len(keep)
        types = getattr(config, "layer_types", None)
        if isinstance(types, list) and len(types) == len(layers):
            config.layer_types = [types[i] for i in keep]
    return student


def apply_fake_quant(
    model: nn.Module, spec: QuantSpec, *, embedding_spec: QuantSpec | None = None
) -> nn.Module:
    """Register `WeightFakeQuant(spec)` on every Linear (and `embedding_spec` on Embeddings)."""
    for module in list(model.modules()):
        if isinstance(module, nn.Linear):
            parametrize.register_parametrization(module, "weight", WeightFakeQuant(spec))
        elif isinstance(module, nn.Embedding) and embedding_spec is not None:
            parametrize.register_parametrization(module, "weight", WeightFakeQuant(embedding_spec))
    return model


def _fake_spec(module: nn.Module) -> QuantSpec | None:
    if not parametrize.is_parametrized(module, "weight"):
        return None
    for p in module.parametrizations["weight"]:
        if isinstance(p, WeightFakeQuant):
            return p.spec
    return None


def export_packed(model: nn.Module) -> nn.Module:
    """Replace fake-quantized Linear/Embedding modules by packed ones (in place); returns model."""
    for name, module in list(model.named_modules()):
        spec = _fake_spec(module)
        if spec is None:
            continue
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        if isinstance(module, nn.Linear):
            packed: nn.Module = QuantLinear.from_linear(module, spec, name=name)
        else:
            packed = QuantEmbedding.from_embedding(module, spec)  # type: ignore[arg-type]
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, packed)
    return model


def compressed_size(model: nn.Module) -> dict[str, int]:
    """Stored bytes: `linear` (Linear/QuantLinear incl. bias), `embedding`, `other` params."""
    sizes = {"linear": 0, "embedding": 0, "other": 0}
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            sizes["linear"] += module.nbytes()
            seen.update(id(p) for p in module.parameters())
        elif isinstance(module, QuantEmbedding):
            sizes["embedding"] += module.nbytes()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            key = "linear" if isinstance(module, nn.Linear) else "embedding"
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    sizes[key] += p.numel() * p.element_size()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            sizes["other"] += p.numel() * p.element_size()
    sizes["total"] = sizes["linear"] + sizes["embedding"] + sizes["other"]
    return sizes


def build_student(
    teacher: nn.Module,
    *,
    bits: int = 1,
    keep_layers: Sequence[int] | None = None,
    embedding_bits: int | None = 1,
    prefix: str | None = None,
) -> nn.Module:
    """The untrained XTC student: reduced layers (if `keep_layers`) + fake-quant weights."""
    student = (
        copy.deepcopy(teacher)
        if keep_layers is None
        else reduce_layers(teacher, keep_layers, prefix=prefix)
    )
    emb = None if embedding_bits is None else xtc_spec(embedding_bits)
    return apply_fake_quant(student, xtc_spec(bits), embedding_spec=emb)


def xtc_compress(
    teacher: nn.Module,
    *,
    bits: int = 1,
    keep_layers: Sequence[int] | None = None,
    steps: int,
    data: Sequence[Mapping[str, Tensor]],
    embedding_bits: int | None = 1,
    lr: float = 2e-4,
    prefix: str | None = None,
    train_embeddings: bool = True,
    history: list[dict[str, float]] | None = None,
) -> nn.Module:
    """Distil a binary (`bits=1`) or ternary (2) student with `keep_layers` from `teacher`.

    `data` is a sequence of model-input batches (`input_ids`, `attention_mask`, ...), cycled
    for `steps` AdamW steps (linear decay of `lr`). The student trains without dropout (eval
    mode) so the short run fits the teacher's deterministic outputs. `train_embeddings=False`
    keeps the (quantized) embedding tables fixed, which makes a step several times cheaper (the
    word table is half of MiniLM's weights). Returns the fake-quantized student;
    `export_packed` turns it into packed layers. Per-step loss parts go to `history`.
    """
    if steps < 0 or not data:
        raise ValueError(
            f"need steps >= 0 and at least one batch, got steps={steps} and {len(data)} batches"
        )
    student = build_student(
        teacher, bits=bits, keep_layers=keep_layers, embedding_bits=embedding_bits, prefix=prefix
    )
    if not train_embeddings:
        for module in student.modules():
            if isinstance(module, nn.Embedding):
                module.requires_grad_(False)
    n_student = len(find_layers(student, prefix)[1])
    mapping = layer_map(n_student, keep_layers)
    teacher.eval()
    student.eval()
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(steps, 1))
    for step in range(steps):
        batch = dict(data[step % len(data)])
        with torch.no_grad():
            t_out = teacher(**batch, output_hidden_states=True)
        s_out = student(**batch, output_hidden_states=True)
        loss, parts = distill_loss(
            s_out, t_out, attention_mask=batch.get("attention_mask"), mapping=mapping
        )
        if not math.isfinite(float(loss.detach())):
            raise FloatingPointError(
                f"XTC distillation loss is {float(loss.detach())} at step {step}"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if history is not None:
            history.append({"step": step, "loss": float(loss.detach()), **parts})
    return student


def xtc_report(
    model_dir: str,
    steps: int,
    *,
    sentences: Sequence[str],
    eval_sentences: Sequence[str],
    bits: int = 1,
    keep_layers: Sequence[int] | None = None,
    embedding_bits: int | None = 1,
    batch_size: int = 16,
    max_length: int = 48,
    lr: float = 2e-4,
    seed: int = 0,
) -> dict[str, Any]:
    """XTC on an encoder in `model_dir`: sizes and held-out embedding cosine to the teacher.

    Trains on `sentences`, measures the mean cosine of mean-pooled embeddings on
    `eval_sentences` for the untrained binarized full model, the untrained student (layer
    reduction + binarization) and the distilled student, all exported packed.
    """
    from zquant.hf import load_model, load_tokenizer
    from zquant.lkd import calibration_batches
    from zquant.metrics import embedding_similarity, sentence_embeddings

    torch.manual_seed(seed)
    teacher = load_model(model_dir, kind="encoder")
    tokenizer = load_tokenizer(model_dir)
    reference = sentence_embeddings(teacher, tokenizer, eval_sentences)
    data = calibration_batches(tokenizer, sentences, batch_size=batch_size, max_length=max_length)

    def cosine(model: nn.Module) -> float:
        return embedding_similarity(model, tokenizer, eval_sentences, reference)

    full = export_packed(build_student(teacher, bits=bits, embedding_bits=embedding_bits))
    untrained = export_packed(
        build_student(teacher, bits=bits, keep_layers=keep_layers, embedding_bits=embedding_bits)
    )
    history: list[dict[str, float]] = []
    student = xtc_compress(
        teacher,
        bits=bits,
        keep_layers=keep_layers,
        steps=steps,
        data=data,
        embedding_bits=embedding_bits,
        lr=lr,
        history=history,
    )
    packed = export_packed(student)
    fp32, small = compressed_size(teacher), compressed_size(packed)
    return {
        "model": str(model_dir),
        "bits": bits,
        "embedding_bits": embedding_bits,
        "keep_layers": list(keep_layers) if keep_layers is not None else None,
        "steps": steps,
        "train_sentences": len(sentences),
        "eval_sentences": len(eval_sentences),
        "cosine_untrained_full_layers": cosine(full),
        "cosine_untrained_student": cosine(untrained),
        "cosine_distilled": cosine(packed),
        "loss_first": history[0]["loss"] if history else None,
        "loss_last": history[-1]["loss"] if history else None,
        "fp32_bytes": fp32,
        "compressed_bytes": small,
        "linear_ratio": fp32["linear"] / small["linear"],
        "model_ratio": fp32["total"] / small["total"],
    }
