# `make run` and `make test` work on a fresh machine: each first sets up .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
# DVC stages call `mnist-pipeline`, so the venv's bin must come first on PATH.
export PATH := $(BIN):$(PATH)

.PHONY: install run test ui lint image-check clean

install: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

run: install
	dvc repro

test: install
	pytest

lint: install
	hadolint Dockerfile

# Builds the Docker image from a local stand-in base and runs the pipeline in it (root, minutes).
image-check: install
	bash scripts/image-check.sh

# The MLflow UI on the default store (SQLite file + ./mlartifacts): http://127.0.0.1:5000
ui: install
	mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///$(CURDIR)/mlflow.db

clean:
	rm -rf data/prepared data/raw models metrics plots reports checks
