"""Sequence (context) parallelism on the mesh's ``cp`` axis: DeepSpeed-Ulysses.

The ranks of one ``cp`` group hold consecutive slices of the same sequences
(``sequence_parallel_size`` in the config). :class:`DistributedAttention` trades slices for
heads around any local attention; :mod:`zcore.sequence.hf` plugs it into Hugging Face
LLaMA-family models (slicing the batch, position ids, the loss over the whole sequence);
:mod:`zcore.sequence.ring` is ring attention (``DistributedAttention(mode="ring")``: key/value
blocks passed around the ``cp`` ranks, no head-count cap);
:mod:`zcore.sequence.tiling` is ALST's tiling (the loss and the MLP a tile of tokens at a time);
:mod:`zcore.sequence.offload` its activation checkpoints kept in host memory
(:func:`checkpoint_layers`).
"""

from zcore.sequence.alltoall import even_split
from zcore.sequence.attention import DistributedAttention, SequenceParallelError, head_plan
from zcore.sequence.offload import checkpoint_layers, host_checkpoint
from zcore.sequence.ring import RingLayout, ring_attention
from zcore.sequence.tiling import tile_causal_lm, tile_mlp, tiled_loss

__all__ = [
    "DistributedAttention",
    "RingLayout",
    "SequenceParallelError",
    "checkpoint_layers",
    "even_split",
    "head_plan",
    "host_checkpoint",
    "ring_attention",
    "tile_causal_lm",
    "tile_mlp",
    "tiled_loss",
]
