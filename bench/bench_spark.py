"""drain backfill vs. Spark's write.jdbc vs. the in-database INSERT ... SELECT, on
local[*] and on a two-worker standalone cluster; an executor killed mid-backfill; a
reconcile.

Stages the same N jobs (``--rows``, default 1,000,000 and 10,000,000:
``search.index_annotation`` with ``{"annotation_id": id}``, priority -10, tag
``backfill.bench``) into an empty ``staged_jobs``, three ways, on each master of
``--masters`` (default ``local,cluster``), in the same run:

* ``drain backfill``: :func:`drain.spark.backfill.run` from a Parquet copy of
  the records (hash-partitioned on the id, deterministic task ids, one COPY
  transaction per partition with its ledger row);
* ``write.jdbc``: Spark's plain ``DataFrame.write.jdbc`` of the same job
  columns (task ids included), batch size 10,000, into the same table;
* ``INSERT ... SELECT``: one statement in Postgres from an ``annotation_<N>``
  table (random task ids), the bulk path of the README.

``local`` is ``local[*]`` as ``drain backfill`` builds it; ``cluster`` is a master
and two 1-core workers (2 GiB, one 1.5 GiB executor each) that the bench starts on
free ports and stops, with this process as the driver (bench/spark_cluster_bench.py).
On each master, each Spark method first runs once on a small input, unmeasured, so
that all measure a warm JVM; then every method runs ``--rounds`` times (each into an
emptied table and ledger) and the best round counts. Every run is checked: exactly N
rows staged.

Then, on the cluster, a backfill of ``--kill-rows`` (default: the largest ``--rows``)
with worker 0's executor killed (kill -9) once half of its partitions committed,
against the same backfill undisturbed; and on each master ``drain reconcile --stage``
of ``--reconcile-rows`` (default: the largest ``--rows``) against a downstream copy
that misses 1 % of the ids and holds an older version of another 1 %. Both are
checked to stage each record exactly once. Prints a table per size, the kill and the
reconcile, and writes bench/results/spark.json. ``make bench-spark``
(``BENCH_SPARK_ARGS="--rows 1000000"`` for a shorter run).

``--smoke`` (a few thousand rows, one round, local[*] only unless ``--masters`` says
otherwise) checks that the bench works; ``make test`` runs it. The figures mean
nothing; it writes bench/results/spark-smoke.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import harness
import psycopg
import spark_cluster_bench as scb

from drain.spark import backfill, mapping, session, sources

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from tests.spark_cluster.standalone import Cluster

M, TASK = scb.M, scb.TASK
BACKFILL = "drain backfill (COPY per partition, Arrow)"
JDBC = "Spark write.jdbc (batchsize 10000)"
SQL = "in-database INSERT ... SELECT"
WARM_UP_ROWS = 200_000
LIMITS = """\
Where this machine's two cores are the limit:
* Postgres (parsing jsonb, updating staged_jobs' indexes, writing WAL) runs on the same
  two cores as Spark: every figure here is Spark and Postgres sharing them, not either
  one alone (nor other people's work on the machine: see the load averages).
* The cluster's two 1-core workers are those same two cores again, next to Postgres, the
  driver (this process) and the master's and workers' JVMs: cluster mode adds executor
  JVMs, Python workers and a shuffle through the block managers, and no core, so it
  cannot scale past local[*] here: a difference either way between the two is the cost
  of cluster mode and the load of the moment. Its figures show that it runs and what it
  costs, not how it scales.
* On a real cluster (executors on their own machines, Postgres on its own) the Spark
  side grows with the executors until Postgres is the limit: every partition COPYs into
  the one staged_jobs table (one heap, its indexes, one WAL stream), so rows/s level
  off near what one Postgres ingests - about what INSERT ... SELECT shows - and
  partitions beyond Postgres' cores only wait on its locks and WAL."""


@dataclasses.dataclass
class Data:
    """N records: a Parquet copy, and the ``annotation_<N>`` table once asked for."""

    n: int
    parquet: str
    table: str | None = None


@dataclasses.dataclass
class Records:
    """The bench's inputs, made once (by whichever session comes first) and kept."""

    url: str
    tmp: str
    found: dict[int, Data] = dataclasses.field(default_factory=dict)

    def get(self, spark: SparkSession, n: int, table: bool = True) -> Data:
        data = self.found.get(n)
        if data is None:
            path = os.path.join(self.tmp, f"annotation-{n}.parquet")
            spark.range(0, n).selectExpr("id", "CAST(id % 1000 AS int) AS user_id") \
                .write.parquet(path)
            data = self.found[n] = Data(n, path)
        if table and data.table is None:
            name = f"annotation_{n}"
            with psycopg.connect(self.url) as conn:
                conn.execute(f"CREATE TABLE {name} (id bigint PRIMARY KEY, user_id int)")
                conn.execute(f"INSERT INTO {name} SELECT i, i %% 1000 "
                             "FROM generate_series(0, %s - 1) i", (n,))
            with psycopg.connect(self.url, autocommit=True) as conn:
                conn.execute(f"VACUUM ANALYZE {name}")
            data.table = name
        return data


@dataclasses.dataclass
class Outcome:
    """Everything one run measured."""

    #: master label -> rows -> method -> best seconds
    best: dict[str, dict[int, dict[str, float]]] = dataclasses.field(default_factory=dict)
    partitions: dict[str, int] = dataclasses.field(default_factory=dict)
    kill: scb.Kill | None = None
    reconciles: list[scb.Reconcile] = dataclasses.field(default_factory=list)
    #: Wall time of each part of the run (sessions, comparisons, kill, reconcile).
    parts: dict[str, float] = dataclasses.field(default_factory=dict)
    load: dict[str, tuple[float, float, float]] = dataclasses.field(default_factory=dict)

    def details(self, args: argparse.Namespace) -> dict[str, Any]:
        return {
            "rows": args.sizes, "rounds": args.rounds,
            "masters": [scb.MASTERS[m] for m in args.masters],
            "backfill_partitions": self.partitions,
            "best_seconds": {label: {str(n): {k: round(v, 3) for k, v in by.items()}
                                     for n, by in sizes.items()}
                             for label, sizes in self.best.items()},
            "executor_kill": self.kill.as_dict() if self.kill else None,
            "reconcile": [r.as_dict() for r in self.reconciles],
            "wall_seconds": {k: round(v, 1) for k, v in self.parts.items()},
            "cores": os.cpu_count(), "load_average": self.load,
            "cluster": {"workers": scb.EXECUTORS, "worker_cores": 1,
                        "worker_memory": scb.WORKER_MEMORY,
                        "executor_memory": scb.EXECUTOR_MEMORY},
        }


def methods(spark: SparkSession, url: str, partitions: int) -> dict[str, Callable[[Data], None]]:
    connection = sources.jdbc_connection(url)

    def run_backfill(data: Data) -> None:
        scb.run_backfill(spark, url, data.parquet, partitions)

    def run_jdbc(data: Data) -> None:
        jobs = mapping.jobs(spark.read.parquet(data.parquet), M, f"jdbc-{uuid.uuid4()}", None)
        jobs.selectExpr(
            "task_id", f"'{TASK}' AS task_name", "args", "kwargs", "CAST(NULL AS string) AS queue",
            f"CAST({M.priority} AS smallint) AS priority", f"'{M.tag}' AS tag",
        ).write.jdbc(
            connection.url + "?stringtype=unspecified", "staged_jobs", mode="append",
            properties={**connection.options(), "batchsize": "10000"},
        )

    def run_sql(data: Data) -> None:
        with psycopg.connect(url) as conn:
            conn.execute(
                "INSERT INTO staged_jobs (task_name, kwargs, priority, tag) "
                "SELECT %s, jsonb_build_object('annotation_id', id), %s, %s "
                f"FROM {data.table}",
                (TASK, M.priority, M.tag),
            )

    return {BACKFILL: run_backfill, JDBC: run_jdbc, SQL: run_sql}


def compare(runs: dict[str, Callable[[Data], None]], url: str, data: Data, rounds: int,
            label: str) -> dict[str, float]:
    """Every method ``rounds`` times on ``data``; the best seconds of each."""
    best: dict[str, float] = {}
    for round_ in range(1, rounds + 1):
        for name, method in runs.items():
            scb.empty(url)
            started = time.perf_counter()
            method(data)
            seconds = time.perf_counter() - started
            count = scb.staged(url)
            if count != data.n:
                raise SystemExit(f"{name} on {label}: staged {count} rows, expected {data.n}")
            print(f"  {label}, {data.n:,} rows, round {round_}: {name:<44} {seconds:7.2f} s "
                  f"{data.n / seconds:>10,.0f} rows/s", flush=True)
            best[name] = min(best.get(name, float("inf")), seconds)
    return best


def parse_args() -> argparse.Namespace:
    parser = harness.parser((__doc__ or "").splitlines()[0], rounds=2)
    parser.add_argument("--rows", default="1000000,10000000",
                        help="comma-separated record counts (default 1000000,10000000)")
    parser.add_argument("--masters", help="comma-separated, of local (local[*]) and cluster "
                        "(a master and two 1-core workers started here); default "
                        "local,cluster (--smoke: local)")
    parser.add_argument("--partitions", type=int,
                        help="drain backfill's write partitions (default: 4 per core, as the CLI)")
    parser.add_argument("--kill-rows", type=int, help="records of the executor-kill run on "
                        "the cluster (default: the largest --rows; 0: none)")
    parser.add_argument("--reconcile-rows", type=int, help="records of the reconcile "
                        "(default: the largest --rows; 0: none)")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.rounds = "5000", 1
    args.sizes = sorted({int(n.replace("_", "")) for n in args.rows.split(",") if n.strip()})
    args.masters = [m.strip() for m in (args.masters or ("local" if args.smoke else
                                                          "local,cluster")).split(",")]
    if not args.sizes or min(args.sizes) < 1 or args.rounds < 1:
        parser.error("--rows needs record counts of at least 1, --rounds at least 1")
    if not args.masters or set(args.masters) - set(scb.MASTERS):
        parser.error(f"--masters takes {' and '.join(scb.MASTERS)}")
    for name in ("kill_rows", "reconcile_rows"):
        if getattr(args, name) is None:
            # A smoke run leaves the reconcile out (200 shuffle tasks a join on local[*]: it
            # would double the smoke's time); --reconcile-rows N adds it.
            setattr(args, name, 0 if args.smoke and name == "reconcile_rows" else
                    max(args.sizes))
    if "cluster" not in args.masters:
        args.kill_rows = 0
    return args


def main() -> int:
    args = parse_args()
    if session.jdbc_jar() is None:
        print("the Postgres JDBC jar is missing: apt-get install libpostgresql-jdbc-java "
              "(or set DRAIN_SPARK_JDBC_JAR)", file=sys.stderr)
        return 2
    print(f"bench-spark: {', '.join(f'{n:,}' for n in args.sizes)} rows on "
          f"{', '.join(scb.MASTERS[m] for m in args.masters)}, {args.rounds} round(s); "
          f"kill run: {args.kill_rows:,} rows; reconcile: {args.reconcile_rows:,} rows; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    out = Outcome(load={"start": os.getloadavg()})
    tmp = tempfile.mkdtemp(prefix="drain-bench-spark-")
    logs = Path(tempfile.mkdtemp(prefix="drain-bench-spark-cluster-"))
    try:
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(scb.database())
            running = None
            if "cluster" in args.masters:
                started = time.perf_counter()
                running = stack.enter_context(scb.cluster(logs))
                out.parts["cluster start"] = time.perf_counter() - started
            records = Records(url, tmp)
            for master in args.masters:
                run_master(args, master, running, records, out)
    except BaseException:
        if "cluster" in args.masters:
            print(f"\nbench-spark failed; the cluster's logs are kept in {logs}",
                  file=sys.stderr)
        else:
            shutil.rmtree(logs, ignore_errors=True)
        raise
    else:
        shutil.rmtree(logs, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out.load["end"] = os.getloadavg()
    write_results(args, report(args, out), out.details(args))
    return 0


def run_master(args: argparse.Namespace, master: str, running: Cluster | None,
               records: Records, out: Outcome) -> None:
    """Everything measured on one master, in one session."""
    label = scb.MASTERS[master]
    started = time.perf_counter()
    with scb.spark_session(master, running) as spark:
        out.parts[f"{label}: session"] = time.perf_counter() - started
        partitions = out.partitions[label] = (args.partitions
                                              or backfill.default_partitions(spark))
        print(f"{label}: {spark.sparkContext.defaultParallelism} cores, {partitions} "
              "backfill partitions; warming up...", flush=True)
        started = time.perf_counter()
        runs = methods(spark, records.url, partitions)
        small = records.get(spark, min(WARM_UP_ROWS, *args.sizes), table=False)
        for name in (BACKFILL, JDBC):
            scb.empty(records.url)
            runs[name](small)
        for n in args.sizes:
            out.best.setdefault(label, {})[n] = compare(
                runs, records.url, records.get(spark, n), args.rounds, label)
        out.parts[f"{label}: comparisons"] = time.perf_counter() - started
        if master == "cluster" and args.kill_rows:
            assert running is not None
            started = time.perf_counter()
            data = records.get(spark, args.kill_rows, table=False)
            out.kill = scb.kill_run(spark, running, records.url, data.parquet,
                                    n=args.kill_rows, partitions=partitions)
            out.parts[f"{label}: executor kill"] = time.perf_counter() - started
        if args.reconcile_rows:
            started = time.perf_counter()
            if not out.reconciles:
                scb.reconcile_tables(records.url, args.reconcile_rows)
                out.parts["reconcile tables"] = time.perf_counter() - started
                started = time.perf_counter()
            out.reconciles.append(scb.reconcile_run(spark, records.url, args.reconcile_rows,
                                                     master))
            out.parts[f"{label}: reconcile"] = time.perf_counter() - started


# -- what it prints and writes ----------------------------------------------------------


def report(args: argparse.Namespace, out: Outcome) -> list[dict[str, Any]]:
    """Prints the tables and notes; returns the result file's summary rows."""
    summary: list[dict[str, Any]] = []
    best, load = out.best, out.load
    for n in args.sizes:
        print(f"\n{n:,} rows, best of {args.rounds} round(s):\n")
        print(f"| {'method':<44} | {'master':<18} | {'seconds':>7} | {'rows/s':>9} | "
              f"{'vs write.jdbc':>13} |")
        print(f"|{'-' * 46}|{'-' * 20}|{'-' * 8}:|{'-' * 10}:|{'-' * 14}:|")
        for label, sizes in best.items():
            for name, seconds in sizes[n].items():
                print(f"| {name:<44} | {label:<18} | {seconds:7.2f} | {n / seconds:9,.0f} | "
                      f"{sizes[n][JDBC] / seconds:12.2f}x |")
        print()
        for label, sizes in best.items():
            times = sizes[n]
            ratio, vs_sql = times[JDBC] / times[BACKFILL], times[SQL] / times[BACKFILL]
            print(f"{label}: drain backfill / write.jdbc {ratio:.2f}x (target >= 2x: "
                  f"{'met' if ratio >= 2 else 'NOT met'}); drain backfill / INSERT ... SELECT "
                  f"{vs_sql:.2f}x")
            summary.append({
                "target": f"drain backfill vs Spark write.jdbc, {n:,} rows, {label}",
                "goal": ">= 2 x write.jdbc",
                "measured": f"{ratio:.2f} x ({n / times[BACKFILL]:,.0f} vs "
                            f"{n / times[JDBC]:,.0f} rows/s; {vs_sql:.2f} x INSERT ... SELECT)",
                "met": ratio >= 2,
            })
        if len(best) == 2:
            (local, by_local), (other, by_cluster) = best.items()
            print(f"{other} / {local}: " + ", ".join(
                f"{name.split(' (')[0]} {by_local[n][name] / by_cluster[n][name]:.2f}x"
                for name in (BACKFILL, JDBC, SQL)))
    if out.kill is not None:
        summary.append(report_kill(out.kill))
    if out.reconciles:
        summary.extend(report_reconciles(out.reconciles))
    print(f"\n{LIMITS}\n\nload average (1, 5, 15 min): at the start "
          f"{', '.join(f'{x:.1f}' for x in load['start'])}; at the end "
          f"{', '.join(f'{x:.1f}' for x in load['end'])}, on {os.cpu_count()} cores")
    print("wall time per part: " + "; ".join(f"{k} {v:.0f} s" for k, v in out.parts.items()))
    return summary


def report_kill(kill: scb.Kill) -> dict[str, Any]:
    n = kill.rows
    print(f"\nbackfill of {n:,} rows on the cluster ({kill.partitions} partitions), worker 0's "
          "executor killed (kill -9) once half of the partitions committed:\n")
    print(f"| {'run':<34} | {'seconds':>7} | {'rows/s':>9} |")
    print(f"|{'-' * 36}|{'-' * 8}:|{'-' * 10}:|")
    print(f"| {'undisturbed':<34} | {kill.undisturbed_seconds:7.2f} | "
          f"{n / kill.undisturbed_seconds:9,.0f} |")
    print(f"| {'executor killed':<34} | {kill.seconds:7.2f} | {n / kill.seconds:9,.0f} |")
    extra = kill.seconds / kill.undisturbed_seconds - 1
    if kill.killed_after is None:
        what = "the run ended before half of the partitions committed: nothing was killed"
    else:
        relaunch = (f"worker 0 started a new executor {kill.relaunched_after:.1f} s after the "
                    "kill" if kill.relaunched_after is not None else
                    "worker 0 started no new executor before the run ended")
        back = (f"both registered with the driver again {kill.executors_back_after:.1f} s "
                "after the kill" if kill.executors_back_after is not None else
                "the driver still had one executor a minute later")
        what = (f"killed after {kill.killed_after}/{kill.partitions} partitions "
                f"({kill.killed_at_seconds:.1f} s in); {relaunch}; {kill.executors_after} "
                f"executor(s) registered when the run ended, {back}; {kill.written} "
                f"partitions written by this run, {kill.retried_after_commit} retried after "
                "their commit")
    print(f"\n{what}. The kill cost {extra:+.0%}; every record staged once (count, "
          "distinct task ids, ledger).")
    return {
        "target": f"backfill with an executor killed half-way, {n:,} rows, cluster",
        "goal": "finishes; each record staged once",
        "measured": f"{kill.seconds:.1f} s vs {kill.undisturbed_seconds:.1f} s undisturbed "
                    f"({extra:+.0%}); " + (f"killed after {kill.killed_after}/"
                                           f"{kill.partitions} partitions"
                                           if kill.killed_after is not None else "not killed"),
        "met": True if kill.killed_after is not None else None,
    }


def report_reconciles(reconciles: list[scb.Reconcile]) -> list[dict[str, Any]]:
    print("\ndrain reconcile --stage (Postgres table against its downstream copy, read "
          "over JDBC; 1 % missing, 1 % stale):\n")
    print(f"| {'master':<18} | {'shuffle':>7} | {'rows':>10} | {'missing':>8} | {'stale':>8} | "
          f"{'staged':>8} | {'seconds':>7} | {'rows/s':>9} | {'staging s':>9} |")
    print(f"|{'-' * 20}|{'-' * 8}:|{'-' * 11}:|{'-' * 9}:|{'-' * 9}:|{'-' * 9}:|{'-' * 8}:|"
          f"{'-' * 10}:|{'-' * 10}:|")
    rows = []
    for r in reconciles:
        print(f"| {r.master:<18} | {r.shuffle_partitions:>7} | {r.rows:>10,} | "
              f"{r.missing:>8,} | {r.stale:>8,} | {r.staged:>8,} | {r.seconds:7.2f} | "
              f"{r.rows / r.seconds:9,.0f} | {r.staging_seconds:9.2f} |")
        rows.append({
            "target": f"reconcile --stage, {r.rows:,} rows, {r.master}",
            "goal": "1 % missing + 1 % stale found exactly, their repairs staged",
            "measured": f"{r.seconds:.1f} s ({r.rows / r.seconds:,.0f} rows/s compared), "
                        f"{r.staged:,} repairs staged in {r.staging_seconds:.1f} s "
                        f"({r.shuffle_partitions} shuffle partitions)",
            "met": True,
        })
    print("\nshuffle: spark.sql.shuffle.partitions, the tasks of every join and aggregation: "
          "on local[*] whatever drain.spark.session.get_session leaves (Spark's default is "
          "200), on the cluster the 8 of docs/spark.md's spark-submit line.")
    return rows


def write_results(args: argparse.Namespace, summary: list[dict[str, Any]],
                  details: dict[str, Any]) -> None:
    """bench/results/spark.json; a smoke run's (spark-smoke.json) has no figures."""
    if args.smoke:
        summary = [{**row, "measured": f"{row['measured']} (smoke: not a figure)"}
                   for row in summary]
    harness.write_results("spark", summary, details, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
