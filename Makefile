# `make run` and `make test` work on a fresh machine: each first sets up .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
# DVC stages call `mnist-pipeline`, so the venv's bin must come first on PATH.
export PATH := $(BIN):$(PATH)

.PHONY: install lock run scaling sweep test test-fast test-fast-coverage test-deps ui show plots lint image-check gpu-check clean

install: $(STAMP)

# Exactly the locked environment, every package checked against its hash: a new lock gets a new
# venv, so nothing a previous lock installed stays behind. pip compiles every module's bytecode
# (docs/testing.md): where PYTHONDONTWRITEBYTECODE is set, as on this project's machines, Python
# never writes it, and each process would compile torch and MLflow anew on every import.
$(VENV)/.locked: requirements-dev.lock
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --require-hashes -r requirements-dev.lock
	touch $@

$(STAMP): $(VENV)/.locked pyproject.toml
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

# Regenerates the locks from the direct requirements (requirements*.txt): the image installs
# requirements.lock, the venv requirements-dev.lock, which is seeded from it so both pin the same
# versions. Add --upgrade to PIP_COMPILE_ARGS to move every transitive pin to its newest release.
PIP_COMPILE_ARGS ?=
PIP_COMPILE := $(BIN)/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	--no-emit-index-url --no-emit-find-links $(PIP_COMPILE_ARGS)
lock: install
	$(PIP_COMPILE) --output-file requirements.lock requirements.txt
	cp requirements.lock requirements-dev.lock
	$(PIP_COMPILE) --output-file requirements-dev.lock requirements-dev.txt

run: install
	dvc repro

# ddp (and fsdp, where train.modes has it) at 1 to 2x the cores (or the GPUs) ranks on this host:
# scaling/report/ and an MLflow run. ARGS="--world-sizes 1,2,4 --modes ddp,fsdp" chooses.
scaling: install
	dvc repro prepare commcheck
	mnist-pipeline scaling $(ARGS)

# A grid of experiments on the Slurm cluster, one array task each; this shell waits for none of them
# (docs/multi-node.md, "Sweeps on a cluster"): make sweep ARGS="-S train.lr=0.01,0.02 -S train.epochs=1,2"
sweep: install
	mnist-pipeline sweep $(ARGS)

# The suite on TEST_WORKERS processes (pytest-xdist), each handed a test file at a time, the longest
# first (tests/conftest.py): a file's module fixtures are made once. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# In two runs: the tests on TEST_WORKERS processes, then those marked `alone` (their claims are
# timings) in one process, with nothing beside them and no worker left waiting for them. The fast
# tier runs once, inside: tests/test_fast_tier.py runs it under coverage and fails when any of its
# tests does. (`pytest` by itself runs every test too, the fast tier twice.)
test: install test-deps
	pytest -m "not fast and not alone" $(XDIST); workers=$$?; \
	pytest -m "alone and not fast"; alone=$$?; \
	exit $$(( workers ? workers : alone ))

# The inner loop: the tests marked `fast`, a few minutes at most; `make test` stays the whole suite.
test-fast: install
	pytest -m fast -q $(XDIST)

# Whether the fast tier runs every module of pipeline/ and stages/, in every process it starts.
test-fast-coverage: install
	$(BIN)/python scripts/fast_tier_coverage.py

# Slurm, munge, PostgreSQL and Chromium for the tests that start them (Debian packages; root only).
test-deps:
	bash scripts/test-deps.sh

lint: install
	hadolint Dockerfile

# Builds the Docker image from a local stand-in base and runs the pipeline in it (root, minutes).
image-check: install
	bash scripts/image-check.sh

# On a host with NVIDIA GPUs: the CUDA tests, then the default pipeline with time to 99%, in one table.
gpu-check: install
	$(BIN)/python scripts/gpu_check.py

# The MLflow UI on the default store (SQLite file + ./mlartifacts): http://127.0.0.1:5000
# It prints the links to the last training: its runs (not MLflow's GenAI pages), its modes and
# each distributed mode's ranks side by side. Without MLflow's GenAI job runner, which this
# pipeline never uses: a runner and its huey consumers, about 2 GB (benchmarks/mlflow_server_cost.py).
ui: install
	@$(BIN)/python -c "from pipeline.tracking.links import print_ui_link; print_ui_link()"
	MLFLOW_DISABLE_TELEMETRY=$${MLFLOW_DISABLE_TELEMETRY:-true} \
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=$${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false} \
	  mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri \
	  "$$($(BIN)/python -c 'from pathlib import Path; from pipeline.tracking.store import sqlite_uri; print(sqlite_uri(Path.cwd() / "mlflow.db"))')"

clean:
	rm -rf data/prepared data/raw models metrics results plots reports checks dvc_plots

# Every experiment's settings and per-mode results, one row per mode (dvc exp show, curated);
# ARGS go to dvc exp show, e.g. make show ARGS=-A
show: install
	@$(BIN)/python scripts/show_experiments.py $(ARGS)

# The DVC charts as one page that needs no network: dvc_plots/index.html
plots: install
	dvc plots show
