"""zcomm: compressed collectives.

This package will own communication-compressed optimizers and collectives
built on ``torch.distributed``: 1-bit Adam, 0/1 Adam and 1-bit LAMB (error
feedback with sign compression done by the native core), and ZeRO++
(quantized weight all-gather qwZ, hierarchical partitioning hpZ, quantized
gradient reduce-scatter qgZ).

Nothing is implemented yet; importing it gives only this docstring and the
version.
"""

__version__ = "0.1.0"
