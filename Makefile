# The two ways in: `make demo` and `make test`. Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test lint bench demo clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[dev]"
	touch $@

lint: setup
	$(VENV)/bin/ruff check astrai tests benchmarks

test: setup lint
	$(VENV)/bin/pytest -q -ra --durations=15

bench: setup
	$(PY) benchmarks/run_all.py

demo: setup
	$(VENV)/bin/astrai demo

clean:
	rm -rf $(VENV) out .pytest_cache
