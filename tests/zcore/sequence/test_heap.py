"""glibc's mmap threshold held fixed (``zcore.sequence.heap``): after a large block is freed,
a smaller one that is still above the threshold is mapped (and so returned on free) rather
than carved from the heap, as it is under glibc's moving threshold. Each case runs in a fresh
interpreter (the threshold and the heap are process state) that loads only ``heap.py``."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

import zcore.sequence.heap as heap
from zcore.sequence.tiling import tile_causal_lm

_PROBE = """
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("heap", sys.argv[1])
heap = importlib.util.module_from_spec(spec); spec.loader.exec_module(heap)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p; libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[2] == "fixed":
    assert heap.fix_mmap_threshold()
libc.free(libc.malloc(8 << 20))  # a tile of logits, freed
before = libc.mallinfo2().hblkhd
block = libc.malloc(1 << 20)
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped_bytes_of_a_1mib_block(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, heap.__file__, mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=True,
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc >= 2.33 (mallinfo2) only"
)
def test_a_fixed_threshold_keeps_mapping_blocks_after_a_larger_free() -> None:
    assert _mapped_bytes_of_a_1mib_block("moving") == 0  # glibc's own: from the heap
    assert _mapped_bytes_of_a_1mib_block("fixed") >= 1 << 20


def test_a_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive byte count, got 0"):
        heap.fix_mmap_threshold(0)


def test_tile_causal_lm_refuses_a_bad_threshold_before_changing_the_model() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
    )
    model = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="got -1"):
        tile_causal_lm(model, mmap_threshold=-1)
    assert "forward" not in model.__dict__
