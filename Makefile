# make test: bootstrap a virtualenv on a fresh machine and run lint, types and the whole suite.
# make test-fast: the quick loop (unit tests only: one process, no S3 server, no ranks, nothing slow).
# make demo: run the main job.  make bench: the performance harness, then its figures.  make docs: the site.
PY ?= python3
# One virtualenv for every target, so `make demo` after `make test` installs nothing: the clone's .venv, or in a git
# worktree its main checkout's once that one is installed (kept up to date from the main checkout, never re-pointed
# at the worktree: its commands run the worktree's code from the current directory); `make VENV=DIR ...` chooses.
MAIN_CHECKOUT := $(patsubst %/.git,%,$(shell git rev-parse --path-format=absolute --git-common-dir 2>/dev/null))
SHARED := $(if $(wildcard $(MAIN_CHECKOUT)/.venv/.installed),$(filter-out $(CURDIR),$(MAIN_CHECKOUT)))
VENV ?= $(if $(SHARED),$(SHARED)/.venv,.venv)
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: test test-fast lint typecheck unit docs demo bench figures clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: anything else may pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python $(if $(SHARED),,pyproject.toml)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '.[dev,deepspeed]'
	touch $(STAMP)

# make bench's extra (issue 29's real weights and ZipNN), on top of the test bootstrap; a worktree sharing the main
# checkout's venv installs it from there, so the editable install keeps pointing at the main checkout.
BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): $(STAMP) $(if $(SHARED),,pyproject.toml)
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '$(or $(SHARED),.)[bench]'
	touch $(BENCH_STAMP)

LINTED := shardckpt tests benchmarks spec examples docs/hooks

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

typecheck: $(STAMP)
	$(BIN)/mypy shardckpt

# Two pytest workers (pytest-xdist): on 2 cores the suite's multi-rank tests leave a core idle ~half the time (waiting
# on sockets, subprocesses and timeouts), so two run in 0.55-0.6x the wall time of one. TEST_WORKERS=0 runs in one
# process; more than the cores only adds gloo timeouts.
TEST_WORKERS ?= 2
unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal --durations=25 tests

# The documentation site, strictly: a broken link or anchor, or a page missing from mkdocs.yml's nav, fails it.
# The CLI and Python API references are generated (docs/hooks/); the Python code blocks run in unit (test_readme).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

test: lint typecheck docs unit

test-fast: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m unit tests

demo: $(STAMP)
	$(BIN)/python -m examples.demo

# Every benchmark row, about 8 minutes on 2 cores plus ~25 for the MoE scale rows and DCP's figures for them: single
# process and 4 gloo ranks vs DCP on the issue's reference state (2 GiB: 64 fp32 tensors of 32 MiB), dcp.save /
# dcp.load through shardckpt.dcp vs DCP's own FileSystemWriter/Reader on it, the training loop's own state, metadata
# scale (dense and DeepSeek-V3 MoE), many small (MoE) tensors vs safetensors and DCP, incremental saves of a
# frozen-base fine-tuning state, S3, a DeepSpeed ZeRO-3 engine vs DeepSpeed's own checkpoints and ds_to_universal,
# shared reads of an HSDP state, and per-block compression on real tensors vs zstd and ZipNN (~3 minutes).
bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks --size-mib 2048 --repeats 5 --json benchmarks/results.json
	$(BIN)/python -m benchmarks.distributed --size-mib 2048 --json benchmarks/distributed.json
	$(BIN)/python -m benchmarks.dcp_backend --size-mib 2048 --json benchmarks/dcp_backend.json
	$(BIN)/python -m benchmarks.torchtitan_save --json benchmarks/torchtitan_save.json
	$(BIN)/python -m benchmarks.loop_state --json benchmarks/loop_state.json
	$(BIN)/python -m benchmarks.scale --ranks 1024 4096 --json benchmarks/scale.json
	$(BIN)/python -m benchmarks.scale_dcp --ranks 1024 4096 --json benchmarks/scale_dcp.json
	$(BIN)/python -m benchmarks.many --tensors 50000 --scale 200000 --check --json benchmarks/many.json
	$(BIN)/python -m benchmarks.incremental --frozen-mib 1024 --trainable-mib 16 --json benchmarks/incremental.json
	$(BIN)/python -m benchmarks.moe --ranks 4 --experts 420 --json benchmarks/moe.json
	$(BIN)/python -m benchmarks.s3
	$(BIN)/python -m benchmarks.ds_engine --json benchmarks/ds_engine.json
	$(BIN)/python -m benchmarks.shared_reads --size-mib 2048 --s3 --json benchmarks/shared_reads.json
	$(BIN)/python -m benchmarks.shared_reads --plan-ranks 1024 4096 16384 --json benchmarks/shared_plan.json
	$(BIN)/python -m benchmarks.local_tier --size-mib 2048 --s3 --json benchmarks/local_tier.json
	$(BIN)/python -m benchmarks.compression --json benchmarks/compression.json
	$(MAKE) figures

# The figures of the performance pages, drawn from the JSON files that make bench wrote (those that exist).
figures: $(STAMP)
	$(BIN)/python -m benchmarks.figures --from benchmarks --out docs/figures

clean:
	rm -rf .venv site .pytest_cache .mypy_cache .ruff_cache .hypothesis
