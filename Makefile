# The single entry point for development and CI (.ci/run calls these targets).
#
#   make venv       .venv with drain and its dev tools (redone when pyproject.toml changes)
#   make services   make sure Postgres and RabbitMQ answer (deploy/ensure-services.sh)
#   make demo       the end-to-end demo: stage, drain, run in a Celery worker; in .venv-demo,
#                   drain's runtime dependencies only. DRAIN_DEMO_DATABASE, DRAIN_DEMO_QUEUE,
#                   DRAIN_DEMO_METRICS_PORT... choose what it creates (celery_app/demo_setup.py)
#   make test       the whole suite, in TEST_WORKERS pytest-xdist workers (default 4; 0: one
#                   process; docs/development.md, "Tests in parallel"); ARGS are passed
#                   to pytest: make test ARGS='-k crash -x'
#   make test-fast  the fast tier, in parallel: tests/unit and the tests/integration tests
#                   that start no subprocess (marker fast, set in tests/conftest.py); a
#                   minute or two, for the edit-test loop. make test stays the full suite
#   make test-unit  only tests/unit (needs no services)
#   make test-spark-cluster  the spark_cluster tests: a standalone Spark cluster (not in make test)
#   make test-rabbit-cluster  the rabbit_cluster tests: a three-node RabbitMQ cluster with quorum
#                   queues, node faults (not in make test; docs/rabbitmq_cluster.md)
#   make lint       ruff check, mypy --strict and make docs
#   make docs       the guides in docs/ as a site (build/site), mkdocs in strict mode: a broken
#                   link or anchor fails it (tests/docs/test_links.py checks the README's)
#   make bench      every benchmark in order, then one summary table (bench/summary.py):
#                   bench-profile (throughput + profile), bench-latency, bench-staging
#                   (concurrent writers, pgbench), bench-mvcc, bench-memory, bench-lanes,
#                   bench-priority (starvation), bench-crashes, bench-paused, bench-curves
#                   (cost against each pile, docs/curves.png); each writes
#                   bench/results/<name>.json
#   make bench-profile  the throughput bench plus one drain round under py-spy: where the
#                   time goes (py-spy)
#   make bench-spark  drain backfill vs write.jdbc vs INSERT ... SELECT at 1M and 10M rows, on
#                   local[*] and a 2-worker standalone cluster it starts; an executor killed
#                   mid-backfill; a 10M-row reconcile --stage (BENCH_SPARK_ARGS="--rows 1000000"
#                   for less; writes bench/results/spark.json); then what a resume of one
#                   missing partition costs (bench/bench_spark_resume.py)
#   make bench-cluster  throughput into a 3-node quorum queue vs a single-node classic queue
#                   vs raw pika into the same quorum queue (bench/bench_cluster.py)
#   make bench-smoke  every benchmark's --smoke mode, one after another: tiny sizes, seconds
#                   each, no figures; checks they still work (make test runs them too, in
#                   tests/bench); each writes bench/results/<name>-smoke.json
#   make soak       the chaos soak (SOAK_SECONDS=180 by default), then the interleavings
#                   and 30,000 commits raced against the drain going idle (test_wakeup)
#   make soak-interleavings  the random-interleavings property test for SOAK_SECONDS (600
#                   by default) instead of make test's 60; replay one with DRAIN_INTERLEAVING_SEED
#   make release    the wheel and sdist of this commit into dist/ (emptied first), checked with
#                   twine check --strict; refuses a tree with uncommitted changes; the version
#                   is git's (a tag vX.Y.Z on the commit: that release, which CHANGELOG.md must
#                   have an entry for; else a dev version, with a warning). docs/development.md,
#                   "Releasing"
#   make clean      remove the venv and caches

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed
# make demo's venv: `pip install -e .`, no extra (~60 MB, not the dev venv's 1.2 GB).
DEMO_VENV ?= .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed
# The one test command; README and CI use it through `make test`.
TEST_CMD := $(BIN)/python -m pytest
ARGS ?=
# make test's parallel workers (TEST_WORKERS=0: one process). Most tests wait on
# subprocesses, Postgres and the broker rather than compute, so more workers than
# cores pays on 2 cores. --dist loadgroup: a file goes whole to one worker (its tests
# share module-scoped fixtures and never run beside each other), except in tests/spark
# and tests/bench, whose tests go one by one (tests/conftest.py, PER_TEST_DIRS;
# docs/development.md, "Tests in parallel").
TEST_WORKERS ?= 4
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
FAST_WORKERS ?= 4

.PHONY: venv demo-venv services demo test test-fast test-unit test-spark-cluster lint docs
.PHONY: test-rabbit-cluster
.PHONY: soak soak-interleavings release clean
.PHONY: bench bench-throughput bench-latency bench-mvcc bench-memory bench-lanes bench-priority
.PHONY: bench-staging bench-crashes bench-paused bench-piles bench-curves
.PHONY: bench-profile bench-spark bench-deps bench-smoke bench-cluster

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

demo-venv: $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -e .
	touch $@

services:
	bash deploy/ensure-services.sh

demo: services demo-venv
	$(DEMO_VENV)/bin/python -m celery_app.demo

# pytest exits 5 when it collected no tests: that is a failure too, and says so.
# Bytecode for drain's and the tests' own modules, written once: where
# PYTHONDONTWRITEBYTECODE is set (as on the CI machines), every process the tests
# start (CLI runs, drains, workers, Spark's Python workers) compiled them again.
define run_tests
	@$(BIN)/python -m compileall -q -j 0 drain tests bench celery_app
	$(info $(strip $(TEST_CMD) $(1)))
	@$(TEST_CMD) $(1) || { status=$$?; \
	  if [ $$status -eq 5 ]; then echo "make: pytest collected no tests (exit 5)" >&2; fi; \
	  exit $$status; }
endef

# The spark_cluster tests (a standalone Spark cluster, minutes) run in test-spark-cluster,
# the rabbit_cluster ones (three RabbitMQ nodes) in test-rabbit-cluster.
test: services venv
	$(call run_tests,$(PARALLEL) -m 'not spark_cluster and not rabbit_cluster' $(ARGS))

test-fast: services venv
	$(call run_tests,-n $(FAST_WORKERS) --dist loadgroup -m fast tests/unit tests/integration $(ARGS))

# drain backfill/reconcile submitted to a real standalone cluster (a master and two
# 1-core workers started by the tests), executors killed mid-run (tests/spark_cluster).
# In one process, not under xdist: each module starts its own cluster (three JVMs and a
# driver), and two at once on 2 cores would starve the executors the tests time and kill.
test-spark-cluster: services venv
	$(call run_tests,-m spark_cluster tests/spark_cluster $(ARGS))

# drain run --app against a three-node RabbitMQ cluster it starts (quorum queues; nodes
# killed, frozen, cut off with iptables and restarted; tests/rabbit_cluster). In one process:
# one cluster for the module, ~10 minutes. Needs root (iptables) and Debian's RabbitMQ.
test-rabbit-cluster: services venv
	$(call run_tests,-s -m rabbit_cluster tests/rabbit_cluster $(ARGS))

test-unit: venv
	$(call run_tests,tests/unit $(ARGS))

lint: venv docs
	$(BIN)/ruff check .
	$(BIN)/mypy

docs: venv
	$(BIN)/mkdocs build --strict --quiet

# One at a time and in this order (they share 2 cores), whatever -j says. Results of an
# earlier run are removed first, so the summary is this run's; a bench that fails shows
# as "not run" and makes `make bench` fail after the summary.
BENCHES := bench-profile bench-latency bench-staging bench-mvcc bench-memory bench-lanes \
	bench-priority bench-crashes bench-paused bench-piles bench-curves

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

# pgbench writers (8, 32, 64) against the shipped trigger, the old NOTIFY-per-statement
# one and no trigger, a drain publishing throughout; writes docs/staging.png.
bench-staging: services bench-deps
	$(BIN)/python bench/bench_staging.py --docs-png

# The plot compares both fetch strategies on ready jobs; the --mix run adds delayed and
# expiring jobs to the keyset drain (its results go to mvcc-mix.json).
bench-mvcc: services bench-deps
	$(BIN)/python bench/bench_mvcc.py --docs-png
	$(BIN)/python bench/bench_mvcc.py --mix --strategies keyset

bench-memory: services bench-deps
	$(BIN)/python bench/bench_memory.py

bench-lanes: services bench-deps
	$(BIN)/python bench/bench_lanes.py

bench-crashes: services bench-deps
	$(BIN)/python bench/bench_crashes.py

bench-paused: services bench-deps
	$(BIN)/python bench/bench_paused.py

bench-piles: services bench-deps
	$(BIN)/python bench/bench_piles.py

# How the cost grows with each pile (backlog, queues, held, refused and locked rows, dead
# jobs, task names): curves in docs/curves.png, each point a ratio in one run (issue 36).
bench-curves: services bench-deps
	$(BIN)/python bench/bench_curves.py --docs-png

bench-priority: services bench-deps
	$(BIN)/python bench/bench_priority.py

bench-profile: services bench-deps
	$(BIN)/python bench/bench_throughput.py --profile

BENCH_SPARK_ARGS ?=

# drain and raw pika into a quorum queue on a three-node RabbitMQ cluster it starts, and the
# drain into a classic queue on the single node (bench/bench_cluster.py; needs root).
bench-cluster: services bench-deps
	$(BIN)/python bench/bench_cluster.py $(BENCH_CLUSTER_ARGS)

bench-spark: services venv
	$(BIN)/python bench/bench_spark.py $(BENCH_SPARK_ARGS)
	$(BIN)/python bench/bench_spark_resume.py

# Every bench's --smoke mode (what tests/bench/test_smoke.py runs), one at a time; a
# failing one does not stop the others, and makes the target fail at the end.
SMOKE_BENCHES := throughput latency staging mvcc memory lanes priority crashes paused piles \
	curves spark

bench-smoke: services venv
	@status=0; for name in $(SMOKE_BENCHES); do \
	  echo "== bench/bench_$$name.py --smoke"; \
	  $(BIN)/python bench/bench_$$name.py --smoke \
	    || { echo "make: bench/bench_$$name.py --smoke failed" >&2; status=1; }; \
	done; \
	exit $$status

# The chaos soak (not part of `make test`): SOAK_SECONDS (default 180), SOAK_RATE,
# SOAK_ROLLBACK, SOAK_FAULTS; then the random interleavings for as long; then
# SOAK_WAKEUP_RACES (default 30000) commits raced against the drain going idle.
soak: services venv
	$(BIN)/python -m tests.soak
	DRAIN_INTERLEAVING_SECONDS=$${SOAK_SECONDS:-180} \
	  $(TEST_CMD) -s tests/integration/test_interleavings.py $(ARGS)
	DRAIN_WAKEUP_RACES=$${SOAK_WAKEUP_RACES:-30000} \
	  $(TEST_CMD) -s tests/integration/test_wakeup.py -k raced $(ARGS)

# tests/integration/test_interleavings.py for longer; its summary goes to
# test-artifacts/interleavings.json.
soak-interleavings: services venv
	DRAIN_INTERLEAVING_SECONDS=$${SOAK_SECONDS:-600} \
	  $(TEST_CMD) -s tests/integration/test_interleavings.py $(ARGS)

# The version is the one hatch-vcs gives the build (pyproject.toml, [tool.hatch.version]),
# read back from the wheel's name. A release version (digits and dots: a tag vX.Y.Z on this
# commit) needs a heading "## X.Y.Z (<date>)" in CHANGELOG.md, not still "(unreleased)";
# without one, dist/ is removed again (nothing there to upload by mistake).
release: venv
	@git rev-parse --git-dir >/dev/null 2>&1 \
	  || { echo "make release: not a git checkout: the version comes from its tags" >&2; exit 1; }
	@if [ -n "$$(git status --porcelain)" ]; then \
	  echo "make release: the working tree has uncommitted changes (git status): commit them first" >&2; \
	  exit 1; \
	fi
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	@set -e; wheel=$$(ls dist/*.whl); version=$${wheel#dist/drain_outbox-}; \
	version=$${version%%-*}; echo "make release: built drain-outbox $$version"; \
	case $$version in \
	  *[!0-9.]*) echo "make release: warning: $$version is a dev version (no tag vX.Y.Z on" \
	    "this commit): not for the package index" >&2 ;; \
	  *) heading=$$(awk -v v="$$version" '$$1 == "##" && $$2 == v' CHANGELOG.md); \
	    if [ -z "$$heading" ]; then \
	      echo "make release: CHANGELOG.md has no entry for $$version (## $$version (<date>))" >&2; \
	      rm -rf dist; exit 1; \
	    fi; \
	    case $$heading in *nreleased*) \
	      echo "make release: CHANGELOG.md still says $$version is unreleased: date it, commit," \
	        "and tag that commit v$$version" >&2; \
	      rm -rf dist; exit 1 ;; \
	    esac ;; \
	esac
	$(BIN)/python -m twine check --strict dist/*.whl dist/*.tar.gz

clean:
	rm -rf $(VENV) $(DEMO_VENV) .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
