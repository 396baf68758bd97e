# The single entry point for development and CI (.ci/run calls these targets).
#
#   make venv       .venv with drain and its dev tools (redone when pyproject.toml changes)
#   make services   make sure Postgres and RabbitMQ answer (deploy/ensure-services.sh)
#   make demo       the end-to-end demo: stage, drain, run in a Celery worker
#   make test       the whole suite; ARGS are passed to pytest: make test ARGS='-k crash -x'
#   make test-unit  only tests/unit (needs no services)
#   make lint       ruff check and mypy --strict
#   make bench      the benchmarks: throughput (bench-throughput), starvation (bench-priority)
#   make bench-spark  drain backfill on local Spark vs write.jdbc vs INSERT ... SELECT (1M rows)
#   make soak       the chaos soak (SOAK_SECONDS=180 by default)
#   make clean      remove the venv and caches

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The one test command; README and CI use it through `make test`.
TEST_CMD := $(BIN)/python -m pytest
ARGS ?=

.PHONY: venv services demo test test-unit lint bench bench-throughput bench-priority bench-spark soak clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

services:
	bash deploy/ensure-services.sh

demo: services venv
	$(BIN)/python -m celery_app.demo

# pytest exits 5 when it collected no tests: that is a failure too, and says so.
define run_tests
	$(info $(strip $(TEST_CMD) $(1)))
	@$(TEST_CMD) $(1) || { status=$$?; \
	  if [ $$status -eq 5 ]; then echo "make: pytest collected no tests (exit 5)" >&2; fi; \
	  exit $$status; }
endef

test: services venv
	$(call run_tests,$(ARGS))

test-unit: venv
	$(call run_tests,tests/unit $(ARGS))

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: bench-throughput bench-priority

bench-throughput: services venv
	$(BIN)/python bench/bench_throughput.py

bench-priority: services venv
	$(BIN)/python bench/bench_priority.py

bench-spark: services venv
	$(BIN)/python bench/bench_spark.py

# The chaos soak (not part of `make test`): SOAK_SECONDS (default 180), SOAK_RATE,
# SOAK_ROLLBACK, SOAK_FAULTS.
soak: services venv
	$(BIN)/python -m tests.soak

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
