# Two commands do everything on a fresh machine: `make repro` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup repro test test-fast ui lint clean lock-check

setup: $(STAMP)

# torch 2.13.0 (CPU build) first, then the pinned lock, then this project without deps.
$(STAMP): requirements/cpu.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade "pip>=24"
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements/cpu.lock
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

# The whole pipeline on the embedded default (CPU, tiny model, local SQLite MLflow store).
repro: setup
	$(BIN)/moe repro

# Every test, the slow end-to-end suites included (what CI runs).
test: setup
	$(BIN)/python -m pytest -q --timeout=1200 -p no:cacheprovider

# Without the slow suites (a few minutes).
test-fast: setup
	$(BIN)/python -m pytest -q --timeout=600 -m "not slow" -p no:cacheprovider

ui: setup
	$(BIN)/moe ui

clean:
	rm -rf data runs metrics plots mlflow.db mlartifacts .dvc/tmp .dvc/cache
