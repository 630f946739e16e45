# Two entry points that work on a fresh machine: `make run` (the default scenarios on the
# simulated device) and `make test` (the suite without the tests marked slow: multi-process
# groups, whole-verb runs, the doc blocks; `make test-slow` runs those, CI runs both). Both create .venv on first use. `run` and `bench` install
# only what running needs; the dev extra (pytest, ruff, and HTA with the pandas and jupyterlab
# it pulls) comes in only for `test` and `lint`.
PYTHON ?= python3
VENV ?= .venv
# The pinned torch is the CPU wheel where one lies on disk (these build machines) and PyPI's
# default build elsewhere. If torch is already importable in the venv it is left alone, so a
# venv made with --system-site-packages keeps a user's CUDA torch.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# --no-compile: Python writes the bytecode of what it imports on first use; compiling every
# module of torch at install time costs time and disk for files most runs never import.
PIP := $(PY) -m pip install -q --no-compile

.PHONY: run test test-slow lint bench install install-dev vllm-oracle clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)" numpy
	$(PIP) -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) -e ".[dev]"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

# vLLM 0.33 as the differential oracle of tests/vllm/ (skipped without it): the release and the
# light packages its DBO modules import, all --no-deps so its CUDA torch pin is never followed.
# After the dev extra, so its pins (transformers 5.x, which vLLM 0.33 needs and which satisfies
# the dev extra's transformers>=4.46) are what stays installed.
vllm-oracle: install-dev
	$(PIP) --no-deps -r .ci/vllm-oracle.txt

run: install
	$(PY) -m scenarios run

test: install-dev
	$(PY) -m pytest -q -m "not slow"

test-slow: install-dev
	$(PY) -m pytest -q -m slow

# The formatter and linter configuration lives in pyproject.toml ([tool.ruff]).
lint: install-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: install
	$(PY) -m scenarios bench

clean:
	rm -rf $(VENV) out
