"""Hugging Face models under ZeRO-3: load straight into partitions, save back whole.

:func:`from_pretrained` builds a transformers model with every parameter partitioned as
``zcore.zero.Init`` would, each rank reading only its own slots from the safetensors files;
:func:`save_pretrained` writes a ZeRO engine's model back as a directory transformers loads
(``config.json`` + ``model.safetensors`` + the tokenizer files), gathering one parameter at a
time. Loading and saving do not import transformers: they use the model class and config the
caller passes (see :mod:`zcore.hf.load` for why transformers' own ZeRO-3 hook cannot be used).

:class:`Trainer` (``zcore.hf.Trainer``, :mod:`zcore.hf.trainer`) is transformers' ``Trainer``
on the zcore engine; it is the one module that imports transformers, loaded on first use.
"""

from typing import Any

from zcore.hf.keys import CheckpointKeyError
from zcore.hf.load import LoadReport, from_pretrained
from zcore.hf.safetensors_io import CheckpointFormatError
from zcore.hf.save import save_pretrained
from zcore.hf.trainer_config import TrainerConfigError, init_config


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from zcore.hf.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'zcore.hf' has no attribute {name!r}")


__all__ = [
    "CheckpointFormatError",
    "CheckpointKeyError",
    "LoadReport",
    "Trainer",
    "TrainerConfigError",
    "from_pretrained",
    "init_config",
    "save_pretrained",
]
