"""zquant: quantization and compression of trained models.

This package will own post-training quantization (ZeroQuant with
layer-by-layer knowledge distillation, INT8/INT4 group-wise weights,
token-wise INT8 activations, FP6 e3m2 weights), extreme compression (XTC
binary/ternary weights with layer reduction), pruning (unstructured, row,
head, channel, N:M), distillation, and the compression composer that reads
DeepSpeed's ``compression_training`` config. It depends on torch and the
native core only, never on zcore, so it can be used on its own.

Nothing is implemented yet; importing it gives only this docstring and the
version.
"""

__version__ = "0.1.0"
