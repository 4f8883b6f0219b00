# One entry point for people, CI and the GPU workflow. Every GitHub Actions `run:` step calls a
# target here or `python -m bench` / `python -m ci`; no logic lives in workflow YAML.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU CI pins the CPU build of torch; a GPU runner sets TORCH_SPEC to its own build (or "" to keep it).
TORCH_SPEC ?= torch==2.13.0
# Index for TORCH_SPEC alone (GitHub-hosted CI: the CPU wheel index); empty: pip's configured indexes.
TORCH_INDEX ?=
# Extra `python -m venv` arguments; a GPU runner passes --system-site-packages to see its CUDA torch.
VENV_ARGS ?=
PYTEST_ARGS ?=
PIPELINE_ARGS ?=
GPU_WORKFLOW := .github/workflows/gpu-bench.yml

.PHONY: setup ci-env test test-slow test-gpu test-gpu-smoke test-fa2-parity lint pipeline gpu-bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH_SPEC)")
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

## ci-env: GitHub Actions only: setup, then put the venv first on PATH for the job's later steps
ci-env: setup
	@test -n "$$GITHUB_PATH" || { echo "ci-env: GITHUB_PATH is unset; this target is for workflow steps (elsewhere: . $(VENV)/bin/activate)" >&2; exit 2; }
	echo "$(abspath $(VENV))/bin" >> "$$GITHUB_PATH"

## test: the CPU suite without the `slow` tests (the README's test command; .ci/run calls it).
## A -m in PYTEST_ARGS replaces the default (PYTEST_ARGS="-m ''" runs everything). worksteal: an idle
## worker takes queued tests from the other, so neither waits out the other's tail (~20 s of 3.5 min)
test: setup
	$(PY) -m pytest -n 2 --dist worksteal -m "not slow" $(PYTEST_ARGS)

## test-slow: only the `slow` tests: the larger shapes of the Triton kernels' interpreter tests
test-slow: setup
	$(PY) -m pytest -n 2 --dist worksteal -m slow $(PYTEST_ARGS)

## lint: ruff over the code, actionlint and zizmor over the workflows (offline: no GitHub API calls)
lint: setup
	$(PY) -m ruff check nsa bench ci tests
	$(VENV)/bin/actionlint
	$(VENV)/bin/zizmor --offline --no-progress .github/workflows

## test-gpu-smoke: the GPU-marked tests other than FA-2 parity (skip with a reason without CUDA)
test-gpu-smoke: setup
	$(PY) -m pytest -m gpu -k "not fa2_parity" -q $(PYTEST_ARGS)

## test-fa2-parity: the FA-2 parity suite against the fp64 oracle (skips with a reason without CUDA)
test-fa2-parity: setup
	NSA_TEST_FA2=1 $(PY) -m pytest -k fa2_parity -q -n 4 $(PYTEST_ARGS)

## test-gpu: both GPU suites
test-gpu: test-gpu-smoke test-fa2-parity

## pipeline: the main job: sweep what this machine can run, decide, report, PR (dry run without a token)
pipeline: setup
	$(PY) -m ci pipeline $(PIPELINE_ARGS)

## gpu-bench: the GPU workflow's jobs on this machine (needs CUDA): gpu, then decide (PR dry run: no token).
## History is kept in NSA_HISTORY_DIR (default out/history-store), so each run compares with the earlier ones.
gpu-bench: TORCH_SPEC =
gpu-bench: VENV_ARGS = --system-site-packages
gpu-bench: setup
	$(PY) -m ci workflow-steps $(GPU_WORKFLOW) --job gpu
	$(PY) -m ci workflow-steps $(GPU_WORKFLOW) --job decide

clean:
	rm -rf $(VENV) out .pytest_cache
