"""QuantLinear: forward paths against the torch reference, packed state_dict, exact reload."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer

from tests.utils.models import minilm_dir
from zquant.nn import QuantLinear
from zquant.quantizers import QuantSpec, dequantize_weight, quantize_activation_tokenwise

SPECS = {
    "w8a8": (QuantSpec(8), 8),
    "w8a8-tensor": (QuantSpec(8, granularity="tensor"), 8),
    "w8": (QuantSpec(8), None),
    "w4a8-g32": (QuantSpec(4, granularity="group", group_size=32), 8),
    "w4-g128-asym": (QuantSpec(4, symmetric=False, granularity="group", group_size=128), None),
    "fp6": (QuantSpec(6, "fp6"), None),
    "binary": (QuantSpec(1, "binary"), None),
    "ternary": (QuantSpec(2, "ternary"), None),
}
#: cosine similarity to the fp32 layer's output on real MiniLM weights (measured, with margin)
FLOORS = {
    "w8a8": 0.999,
    "w8a8-tensor": 0.997,
    "w8": 0.9999,
    "w4a8-g32": 0.99,
    "w4-g128-asym": 0.99,
    "fp6": 0.999,
    "binary": 0.78,
    "ternary": 0.88,
}


@pytest.fixture(scope="module")
def minilm_layer() -> tuple[torch.nn.Linear, torch.Tensor]:
    """MiniLM's first FFN up-projection (384 -> 1536) and real token embeddings as inputs."""
    path = minilm_dir()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        w = f.get_tensor("encoder.layer.0.intermediate.dense.weight")
        b = f.get_tensor("encoder.layer.0.intermediate.dense.bias")
        emb = f.get_tensor("embeddings.word_embeddings.weight")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode(
        "Now is the winter of our discontent made glorious summer by this sun of York."
    ).ids
    x = F.layer_norm(emb[ids] * 8, (emb.shape[1],))  # token embeddings at a post-LayerNorm scale
    linear = torch.nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(b)
    return linear, x


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("backend", ["auto", "torch", "native"])
def test_forward_matches_reference_and_reloads_exactly(
    name: str, backend: str, minilm_layer: tuple[torch.nn.Linear, torch.Tensor]
) -> None:
    linear, x = minilm_layer
    spec, act_bits = SPECS[name]
    layer = QuantLinear.from_linear(
        linear, spec, act_bits, name="encoder.layer.0.intermediate.dense"
    )
    layer.backend = backend  # type: ignore[assignment]
    with torch.no_grad():
        y = layer(x)
        deq = dequantize_weight(layer.quantized_weight())
        if layer.path == "w8a8":
            q, s = quantize_activation_tokenwise(x)
            ref = (q.double() @ layer.qdata.double().t()).float() * (
                s * layer.qscale.reshape(1, -1)
            ) + linear.bias
            tol = 1e-6
        else:
            ref = F.linear(x, deq, linear.bias) if act_bits is None else None
            tol = 1e-4
        if ref is not None:
            assert torch.allclose(y, ref, atol=tol, rtol=1e-5), float((y - ref).abs().max())
        # Against the fp32 layer: quantization error, stated per format.
        full = linear(x)
        cos = F.cosine_similarity(y.flatten(), full.flatten(), dim=0).item()
        floor = FLOORS[name]
        assert cos >= floor, (name, cos)
    state = layer.state_dict()
    assert "weight" not in state and {"qdata", "qscale", "qmeta", "qact", "bias"} <= set(state)
    again = QuantLinear.from_state(dict(state), name="reloaded")
    again.backend = backend  # type: ignore[assignment]
    fresh = QuantLinear.from_linear(torch.nn.Linear(384, 1536), spec, act_bits)
    fresh.load_state_dict(state)
    fresh.backend = backend  # type: ignore[assignment]
    with torch.no_grad():
        assert torch.equal(again(x), y) and torch.equal(fresh(x), y)


def test_w8a8_native_kernel_equals_torch_path(
    minilm_layer: tuple[torch.nn.Linear, torch.Tensor],
) -> None:
    linear, x = minilm_layer
    layer = QuantLinear.from_linear(linear, QuantSpec(8), act_bits=8)
    with torch.no_grad():
        layer.backend = "torch"
        y_torch = layer(x.reshape(1, *x.shape))
        layer.backend = "native"
        y_native = layer(x.reshape(1, *x.shape))
    # Same int32 sums and the same float32 epilogue: bit-identical.
    assert torch.equal(y_torch, y_native) and y_native.shape == (1, x.shape[0], 1536)


def test_packed_sizes_and_repr() -> None:
    linear = torch.nn.Linear(576, 1536)
    fp32 = linear.weight.numel() * 4
    int4 = QuantLinear.from_linear(linear, QuantSpec(4, granularity="group", group_size=128))
    binary = QuantLinear.from_linear(linear, QuantSpec(1, "binary"))
    assert int4.quantized_weight().nbytes() == 1536 * 288 + 1536 * 5 * 4  # 576 pads to 5 groups
    assert fp32 / binary.quantized_weight().nbytes() >= 16
    assert "int4 sym group128" in repr(int4) and "weight-only" in repr(int4)


def test_bad_inputs_name_the_layer() -> None:
    linear = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"layer 'fc'.*act_bits=16"):
        QuantLinear.from_linear(linear, QuantSpec(8), act_bits=16, name="fc")
    with pytest.raises(ValueError, match=r"layer 'fc'.*group_size=0"):
        QuantLinear.from_linear(linear, QuantSpec(4, granularity="group", group_size=0), name="fc")
    layer = QuantLinear.from_linear(linear, QuantSpec(8), name="fc")
    with pytest.raises(ValueError, match="layer 'fc': input has 5 features, weight expects 8"):
        layer(torch.randn(2, 5))


def test_gradient_flows_to_inputs_of_weight_only_layers() -> None:
    layer = QuantLinear.from_linear(
        torch.nn.Linear(16, 8), QuantSpec(4, granularity="group", group_size=8)
    )
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).sum().backward()
    want = dequantize_weight(layer.quantized_weight()).sum(dim=0).expand(3, 16)
    assert x.grad is not None and torch.allclose(x.grad, want, atol=1e-6)
