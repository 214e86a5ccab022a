# make test: bootstrap a virtualenv on a fresh machine and run lint, types and the whole suite.
# make demo: run the main job.  make bench: the performance harness.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: test lint typecheck unit demo bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: anything else may pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check shardckpt tests benchmarks spec
	$(BIN)/ruff format --check shardckpt tests benchmarks spec

typecheck: $(STAMP)
	$(BIN)/mypy shardckpt

unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

test: lint typecheck unit

demo: $(STAMP)
	$(BIN)/python -m shardckpt.demo

bench: $(STAMP)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
