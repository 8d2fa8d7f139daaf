# One command each: `make test` (fresh clone -> .venv -> whole test suite) and `make run` (the default job).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-slow run lint bench-gae gpu-suite

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch comes from this machine's disk; install it first so nothing pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[runtime,dev]'
	# SGLang's API for the tests, without its dependencies (see the sglang-api extra in pyproject.toml).
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q

# The tests marked slow (deselected by `make test`): the learning runs, the parametrizations and drills that repeat a
# mechanism the default suite already runs, each with its reason. `-m 'slow or not slow'` runs all.
test-slow: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -m slow

run: $(STAMP)
	$(BIN)/rlcore-run

bench-gae: $(STAMP)
	$(BIN)/python tools/bench_gae.py

# Every tests/test_*_cuda.py and the headline benches on this machine's GPUs; rewrites docs/gpu-results.md.
gpu-suite: $(STAMP)
	$(BIN)/python tools/gpu_suite.py
