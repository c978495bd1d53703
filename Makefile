# `make demo` and `make test` set everything up from nothing, then run.
PYTHON ?= python3
VENV   ?= .venv
# The torch build to install before the package. On Linux x86_64 the default
# wheel of this release is a CUDA build, so a machine with a GPU gets one; pick
# another build with e.g. `make test TORCH="torch==2.13.0+cpu"`.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test test-slow bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python tools/demo.py

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

test-slow: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs
