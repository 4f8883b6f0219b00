# One entry point for people, CI and the GPU workflow. Every GitHub Actions `run:` step calls a
# target here or `python -m bench` / `python -m ci`; no logic lives in workflow YAML.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU CI pins the CPU build of torch; a GPU runner sets TORCH_SPEC to its own build (or "" to keep it).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test test-gpu lint pipeline gpu-bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

## test: the CPU suite (the README's test command; .ci/run calls it)
test: setup
	$(PY) -m pytest -n 2 $(PYTEST_ARGS)

## lint: ruff over the code, actionlint and zizmor over the workflows
lint: setup
	$(PY) -m ruff check nsa bench ci tests
	$(VENV)/bin/actionlint
	$(VENV)/bin/zizmor --offline --min-severity medium .github/workflows

## test-gpu: the GPU smoke and FA-2 parity suites (needs CUDA)
test-gpu:
	NSA_TEST_FA2=1 $(PYTHON) -m pytest -m gpu -x -q $(PYTEST_ARGS)

## pipeline: the main job: sweep what this machine can run, decide, report, PR (dry run without a token)
pipeline: setup
	$(PY) -m ci pipeline

clean:
	rm -rf $(VENV) out .pytest_cache
