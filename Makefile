# Two entry points that work on a fresh machine: `make run` (the default scenarios on the
# simulated device) and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
# The pinned torch is the CPU wheel where one lies on disk (these build machines) and PyPI's
# default build elsewhere. If torch is already importable in the venv it is left alone, so a
# venv made with --system-site-packages keeps a user's CUDA torch.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: run test lint bench install vllm-oracle clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)" numpy
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# vLLM 0.33 as the differential oracle of tests/vllm/ (skipped without it): the release and the
# light packages its DBO modules import, all --no-deps so its CUDA torch pin is never followed.
vllm-oracle: install
	$(PY) -m pip install -q --no-deps -r .ci/vllm-oracle.txt

run: install
	$(PY) -m scenarios run

test: install
	$(PY) -m pytest -q

# The formatter and linter configuration lives in pyproject.toml ([tool.ruff]).
lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: install
	$(PY) -m scenarios bench

clean:
	rm -rf $(VENV) out
