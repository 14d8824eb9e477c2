"""zquant: quantization and compression of trained models.

Post-training quantization (ZeroQuant, with layer-by-layer knowledge distillation or GPTQ
rounding),
INT8/INT4 group-wise weights, token-wise INT8 activations, FP6 (e3m2) weights in a 4+2-bit
split, extreme compression (XTC: binary/ternary weights, layer reduction, distillation),
pruning (unstructured, row, head, channel, N:M; N:M also found by ADMM) with
``redundancy_clean``, and the composer
that reads DeepSpeed's ``compression_training`` config. Quantized models save and load as
packed safetensors. It depends on torch and the native core only, never on zcore.

The names below load their modules on first use, so ``import zquant`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from zquant.admm_nm import ADMMConfig, admm_nm_prune, magnitude_nm, nm_project
    from zquant.clean import count_parameters, redundancy_clean
    from zquant.compression import (
        CompressionConfig,
        CompressionConfigError,
        compression_scheduler,
        init_compression,
    )
    from zquant.gptq import gptq_weight, quantize_gptq
    from zquant.lkd import calibration_batches, distill
    from zquant.metrics import (
        embedding_similarity,
        perplexity,
        sentence_embeddings,
        sentences_from_text,
    )
    from zquant.nn import OutlierQuantLinear, QuantLinear
    from zquant.pruning import (
        PruneMask,
        prune_channels,
        prune_heads,
        prune_nm,
        prune_rows,
        prune_sparse,
    )
    from zquant.ptq import model_size, quantize
    from zquant.quantizers import (
        QuantizedWeight,
        QuantSpec,
        dequantize_weight,
        fake_quantize,
        fake_quantize_activation,
        quantize_activation_tokenwise,
        quantize_weight,
    )
    from zquant.schemes import RECIPE_NAMES, LayerRule, Recipe, get_recipe
    from zquant.serialize import load_quantized, save_quantized
    from zquant.xtc import QuantEmbedding, compressed_size, export_packed, xtc_compress

_EXPORTS = {
    "ADMMConfig": "zquant.admm_nm",
    "admm_nm_prune": "zquant.admm_nm",
    "magnitude_nm": "zquant.admm_nm",
    "nm_project": "zquant.admm_nm",
    "count_parameters": "zquant.clean",
    "redundancy_clean": "zquant.clean",
    "CompressionConfig": "zquant.compression",
    "CompressionConfigError": "zquant.compression",
    "compression_scheduler": "zquant.compression",
    "init_compression": "zquant.compression",
    "gptq_weight": "zquant.gptq",
    "quantize_gptq": "zquant.gptq",
    "calibration_batches": "zquant.lkd",
    "distill": "zquant.lkd",
    "embedding_similarity": "zquant.metrics",
    "perplexity": "zquant.metrics",
    "sentence_embeddings": "zquant.metrics",
    "sentences_from_text": "zquant.metrics",
    "QuantLinear": "zquant.nn",
    "OutlierQuantLinear": "zquant.nn",
    "model_size": "zquant.ptq",
    "quantize": "zquant.ptq",
    "PruneMask": "zquant.pruning",
    "prune_channels": "zquant.pruning",
    "prune_heads": "zquant.pruning",
    "prune_nm": "zquant.pruning",
    "prune_rows": "zquant.pruning",
    "prune_sparse": "zquant.pruning",
    "QuantSpec": "zquant.quantizers",
    "QuantizedWeight": "zquant.quantizers",
    "dequantize_weight": "zquant.quantizers",
    "fake_quantize": "zquant.quantizers",
    "fake_quantize_activation": "zquant.quantizers",
    "quantize_activation_tokenwise": "zquant.quantizers",
    "quantize_weight": "zquant.quantizers",
    "RECIPE_NAMES": "zquant.schemes",
    "LayerRule": "zquant.schemes",
    "Recipe": "zquant.schemes",
    "get_recipe": "zquant.schemes",
    "load_quantized": "zquant.serialize",
    "save_quantized": "zquant.serialize",
    "QuantEmbedding": "zquant.xtc",
    "compressed_size": "zquant.xtc",
    "export_packed": "zquant.xtc",
    "xtc_compress": "zquant.xtc",
}

__all__ = [
    "RECIPE_NAMES",
    "ADMMConfig",
    "CompressionConfig",
    "CompressionConfigError",
    "LayerRule",
    "OutlierQuantLinear",
    "PruneMask",
    "QuantEmbedding",
    "QuantLinear",
    "QuantSpec",
    "QuantizedWeight",
    "Recipe",
    "__version__",
    "admm_nm_prune",
    "calibration_batches",
    "compressed_size",
    "compression_scheduler",
    "count_parameters",
    "dequantize_weight",
    "distill",
    "embedding_similarity",
    "export_packed",
    "fake_quantize",
    "fake_quantize_activation",
    "get_recipe",
    "gptq_weight",
    "init_compression",
    "load_quantized",
    "magnitude_nm",
    "model_size",
    "nm_project",
    "perplexity",
    "prune_channels",
    "prune_heads",
    "prune_nm",
    "prune_rows",
    "prune_sparse",
    "quantize",
    "quantize_activation_tokenwise",
    "quantize_gptq",
    "quantize_weight",
    "redundancy_clean",
    "save_quantized",
    "sentence_embeddings",
    "sentences_from_text",
    "xtc_compress",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zquant' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
