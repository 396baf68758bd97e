# The single entry point for development and CI (.ci/run calls these targets).
#
#   make venv       .venv with drain and its dev tools (redone when pyproject.toml changes)
#   make services   make sure Postgres and RabbitMQ answer (deploy/ensure-services.sh)
#   make demo       the end-to-end demo: stage, drain, run in a Celery worker
#   make test       the whole suite; ARGS are passed to pytest: make test ARGS='-k crash -x'
#   make test-unit  only tests/unit (needs no services)
#   make lint       ruff check and mypy --strict
#   make bench      every benchmark in order, then one summary table (bench/summary.py):
#                   bench-profile (throughput + profile), bench-latency, bench-mvcc, bench-memory, bench-lanes,
#                   bench-priority (starvation); each writes bench/results/<name>.json
#   make bench-profile  the throughput bench plus one drain round under py-spy: where the
#                   time goes (py-spy)
#   make bench-spark  drain backfill on local Spark vs write.jdbc vs INSERT ... SELECT (1M rows)
#   make soak       the chaos soak (SOAK_SECONDS=180 by default)
#   make clean      remove the venv and caches

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed
# The one test command; README and CI use it through `make test`.
TEST_CMD := $(BIN)/python -m pytest
ARGS ?=

.PHONY: venv services demo test test-unit lint soak clean
.PHONY: bench bench-throughput bench-latency bench-mvcc bench-memory bench-lanes bench-priority
.PHONY: bench-profile bench-spark bench-deps

venv: $(STAMP)

# The benchmarks' own extras (matplotlib, py-spy) on top of the dev venv.
bench-deps: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	touch $@

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

# One at a time and in this order (they share 2 cores), whatever -j says. Results of an
# earlier run are removed first, so the summary is this run's; a bench that fails shows
# as "not run" and makes `make bench` fail after the summary.
BENCHES := bench-profile bench-latency bench-mvcc bench-memory bench-lanes bench-priority

bench: services bench-deps
	rm -f bench/results/*.json
	@status=0; for target in $(BENCHES); do \
	  $(MAKE) --no-print-directory $$target || status=1; \
	done; \
	$(BIN)/python bench/summary.py; \
	exit $$status

bench-throughput: services bench-deps
	$(BIN)/python bench/bench_throughput.py

bench-latency: services bench-deps
	$(BIN)/python bench/bench_latency.py

bench-mvcc: services bench-deps
	$(BIN)/python bench/bench_mvcc.py --docs-png

bench-memory: services bench-deps
	$(BIN)/python bench/bench_memory.py

bench-lanes: services bench-deps
	$(BIN)/python bench/bench_lanes.py

bench-priority: services bench-deps
	$(BIN)/python bench/bench_priority.py

bench-profile: services bench-deps
	$(BIN)/python bench/bench_throughput.py --profile

bench-spark: services venv
	$(BIN)/python bench/bench_spark.py

# The chaos soak (not part of `make test`): SOAK_SECONDS (default 180), SOAK_RATE,
# SOAK_ROLLBACK, SOAK_FAULTS.
soak: services venv
	$(BIN)/python -m tests.soak

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
