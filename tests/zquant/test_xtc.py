"""XTC on all-MiniLM-L6-v2: binary weights + layer reduction + one-stage distillation.

Sizes are counted exactly from the packed modules (1 bit per binary weight, one fp32 scale per
row, fp32 biases and LayerNorms). The quality check is the mean cosine between the student's
and the teacher's mean-pooled embeddings on held-out Shakespeare sentences, untrained
binarization vs. after a short distillation (`xtc_report` runs the longer version).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.zquant.compress_utils import encode, minilm, pooled, shakespeare_sentences
from zquant.nn import QuantLinear
from zquant.quantizers import dequantize_weight, quantize_weight
from zquant.xtc import (
    QuantEmbedding,
    WeightFakeQuant,
    build_student,
    compressed_size,
    export_packed,
    reduce_layers,
    xtc_compress,
    xtc_spec,
)

KEEP = [1, 3, 5]


def test_reduce_layers_copies_the_kept_teacher_layers() -> None:
    teacher = minilm()
    student = reduce_layers(teacher, [0, 2, 4])
    assert len(student.encoder.layer) == 3 and student.config.num_hidden_layers == 3
    assert len(teacher.encoder.layer) == 6  # the teacher is untouched
    for j, i in enumerate([0, 2, 4]):
        a, b = student.encoder.layer[j].state_dict(), teacher.encoder.layer[i].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"keep_layers \[4, 2\] must be distinct ascending"):
        reduce_layers(teacher, [4, 2])
    with pytest.raises(ValueError, match=r"keep_layers \[0, 6\].*6 layers of 'encoder.layer'"):
        reduce_layers(teacher, [0, 6])


def test_weight_fake_quant_is_the_packed_binary_weight_with_a_straight_through_gradient() -> None:
    w = minilm().encoder.layer[0].intermediate.dense.weight.detach().clone().requires_grad_()
    spec = xtc_spec(1)
    fake = WeightFakeQuant(spec)(w)
    assert torch.equal(fake, dequantize_weight(quantize_weight(w.detach(), spec)))
    fake.sum().backward()  # straight-through: the latent weight gets the gradient unchanged
    assert torch.equal(w.grad, torch.ones_like(w))


def test_binary_student_is_over_16x_smaller_counting_scales() -> None:
    teacher = minilm()
    packed = export_packed(build_student(teacher, bits=1, keep_layers=KEEP, embedding_bits=1))
    assert isinstance(packed.encoder.layer[0].intermediate.dense, QuantLinear)
    assert isinstance(packed.embeddings.word_embeddings, QuantEmbedding)
    fp32, small = compressed_size(teacher), compressed_size(packed)
    # Teacher: 22,713,216 fp32 parameters. Linears: per layer 4*384*384 + 2*384*1536 weights
    # + 3456 biases; plus the 384x384 pooler.
    assert fp32["total"] == 22_713_216 * 4
    assert fp32["linear"] == 6 * (1_769_472 + 3456) * 4 + (384 * 384 + 384) * 4
    # Student linears, per kept layer: 1,769,472 bits = 221,184 B + 3456 row scales and 3456
    # biases in fp32 (13,824 B each) = 248,832 B; pooler 384*48 + 384*4 + 384*4 = 21,504 B.
    assert small["linear"] == 3 * 248_832 + 21_504
    # Embeddings (binary, one scale per row): 30522 words, 512 positions, 2 token types,
    # each row 384/8 = 48 B + 4 B scale.
    assert small["embedding"] == (30522 + 512 + 2) * (48 + 4)
    # LayerNorms stay fp32: embeddings' and 2 per kept layer, 768 parameters each.
    assert small["other"] == (1 + 2 * 3) * 768 * 4
    linear_ratio = fp32["linear"] / small["linear"]
    model_ratio = fp32["total"] / small["total"]
    assert linear_ratio == pytest.approx(56.17, abs=0.01)
    assert model_ratio == pytest.approx(37.80, abs=0.01)
    assert model_ratio >= 16
    # The packed table dequantizes only the looked-up rows, to the same values.
    ids = encode(shakespeare_sentences()[:4])["input_ids"]
    table = packed.embeddings.word_embeddings
    assert torch.equal(table(ids), F.embedding(ids, dequantize_weight(table.quantized_weight())))


def test_distillation_beats_untrained_binarization() -> None:
    torch.manual_seed(0)
    teacher = minilm()
    train = shakespeare_sentences("train", 400)
    data = [encode(train[i : i + 8], max_length=32) for i in range(0, 160, 8)]
    held_out = encode(shakespeare_sentences("val", 48), max_length=32)
    # Frozen (binarized) embedding tables keep a step cheap on a shared 2-core CPU; the
    # benchmark's `xtc_report` trains them too.
    with torch.no_grad():
        reference = pooled(teacher, held_out)

    def cosine(model) -> float:
        with torch.no_grad():
            return float(F.cosine_similarity(pooled(model, held_out), reference, dim=-1).mean())

    untrained = export_packed(build_student(teacher, bits=1, keep_layers=KEEP, embedding_bits=1))
    history: list[dict[str, float]] = []
    student = xtc_compress(
        teacher,
        bits=1,
        keep_layers=KEEP,
        steps=40,
        data=data,
        lr=5e-4,
        train_embeddings=False,
        history=history,
    )
    fake_cos = cosine(student)
    with torch.no_grad():
        fake_out = student(**held_out).last_hidden_state
    packed = export_packed(student)
    with torch.no_grad():
        packed_out = packed(**held_out).last_hidden_state
    # The packed 1-bit model computes what the fake-quantized student trained as.
    assert torch.allclose(packed_out, fake_out, atol=1e-4, rtol=1e-4)
    before, after = cosine(untrained), cosine(packed)
    print(f"\nXTC MiniLM 6->3 layers, binary: cosine untrained {before:.4f}, distilled {after:.4f}")
    assert after == pytest.approx(fake_cos, abs=1e-5)
    assert history[-1]["loss"] < history[0]["loss"]
    assert after > before + 0.1, (before, after)
