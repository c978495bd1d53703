# `make demo` and `make test` set everything up from nothing, then run.
PYTHON ?= python3
VENV   ?= .venv
# The torch build to install before the package. On Linux x86_64 the default
# wheel of this release is a CUDA build, so a machine with a GPU gets one; pick
# another release or build with e.g. `make test TORCH="torch==2.9.1"`.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

# Benchmarks compare against timm, which needs torchvision and the torch it was built for.
BENCH_VENV  ?= .venv-bench
BENCH_TORCH ?= torch==2.14.1 torchvision==0.29.1

.PHONY: install lock demo study test test-slow bench test-bench clean

# Every package at the version requirements.lock names (the ones `make test` passed with).
$(VENV)/.installed: pyproject.toml requirements.lock Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH)"
	$(PIP) install -r requirements.lock
	$(PIP) install --no-deps -e .
	touch $@

# Only set up the environment, e.g. in another place: `make install VENV=../mpp-venv`.
install: $(VENV)/.installed

# Resolve pyproject.toml's ranges afresh, in an environment of their own, into requirements.lock
# (its comment lines kept; torch left to TORCH); then `make test` says whether the new versions pass.
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip --disable-pip-version-check -q install --upgrade pip
	$(LOCK_VENV)/bin/python -m pip --disable-pip-version-check -q install "$(TORCH)"
	$(LOCK_VENV)/bin/python -m pip --disable-pip-version-check -q install -e ".[test]"
	{ grep '^#' requirements.lock; $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable \
		| grep -v -E '^(torch|triton|nvidia-|pip)[=-]'; } > requirements.lock.new
	mv requirements.lock.new requirements.lock
	rm -rf $(LOCK_VENV)

# Pretrain a small ViT on the embedded FashionMNIST shards, then fine-tune it next to the same
# classifier trained from scratch, and print the comparison (minutes on two CPU cores).
demo: $(VENV)/.installed
	$(BIN)/python -m experiments.compare --out runs/demo

# Does MPP help? Six arms (the hybrid's two among them) x 3 seeds x 2 label budgets, learning rates chosen on
# a held-out split, and the ablation of the objective, into results/study (hours on two CPU cores; it resumes).
study: $(VENV)/.installed
	$(BIN)/python -m experiments.study --results results/study

# Lint, format and types first (seconds), then the tests on two workers, a file to a worker, in the
# order tests/conftest.py sets (--no-loadscope-reorder keeps it); the 20 longest tests close the output.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(VENV)/.installed
	$(BIN)/ruff check mpp experiments benchmarks tests
	$(BIN)/ruff format --check mpp experiments benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -q --durations=20 $(XDIST)

test-slow: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m slow $(XDIST)

$(BENCH_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip --disable-pip-version-check -q install $(BENCH_TORCH)
	$(BENCH_VENV)/bin/python -m pip --disable-pip-version-check -q install -e ".[bench,gpu-decode,test]"
	touch $@

bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python -m benchmarks.bench_step --batch 8 --repeats 5

# The tests that need torchvision (decode="device" on the CPU), in the bench environment.
test-bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python -m pytest -q -m bench

clean:
	rm -rf $(VENV) $(BENCH_VENV) runs
