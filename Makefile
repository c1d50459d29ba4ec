# `make test` and `make demo` work from a clean clone: they build .venv and install what they need.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SHARED ?= $(abspath ../shared)
export LMD_DATA_DIR ?= $(SHARED)/data
export LMD_MODELS_DIR ?= $(SHARED)/models
DEMO_DIR ?= demo_out

.PHONY: venv test test-fast lint demo clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU machines take the local CPU wheel; a multi-GB CUDA build is never downloaded in CI.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -q "torch>=2.4,<2.15"; \
	else \
		$(PIP) install -q torch==2.13.0; \
	fi
	$(PIP) install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q -x --timeout=1800 tests

test-fast: venv
	$(PY) -m pytest -q -m "not slow" tests

lint: venv
	$(VENV)/bin/ruff check lmd tests benchmarks

demo: venv
	$(PY) -m lmd.demo --out $(DEMO_DIR)

clean:
	rm -rf $(VENV) $(DEMO_DIR)
