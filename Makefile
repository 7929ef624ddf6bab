# `make test` and `make run` each build .venv when it is missing, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch unless a CUDA driver is present (never a CUDA build on a CPU machine).
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

.PHONY: setup test test-fast run bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

run: setup
	$(VENV)/bin/support-replay train

bench: setup
	$(PY) bench/wire.py
	$(PY) bench/kernels.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
