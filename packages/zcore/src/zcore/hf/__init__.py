"""Hugging Face models under ZeRO-3: load straight into partitions, save back whole.

:func:`from_pretrained` builds a transformers model with every parameter partitioned as
``zcore.zero.Init`` would, each rank reading only its own slots from the safetensors files;
:func:`save_pretrained` writes a ZeRO engine's model back as a directory transformers loads
(``config.json`` + ``model.safetensors`` + the tokenizer files), gathering one parameter at a
time. zcore does not import transformers: it uses the model class and config the caller
passes (see :mod:`zcore.hf.load` for why transformers' own ZeRO-3 hook cannot be used).
"""

from zcore.hf.keys import CheckpointKeyError
from zcore.hf.load import LoadReport, from_pretrained
from zcore.hf.safetensors_io import CheckpointFormatError
from zcore.hf.save import save_pretrained

__all__ = [
    "CheckpointFormatError",
    "CheckpointKeyError",
    "LoadReport",
    "from_pretrained",
    "save_pretrained",
]
