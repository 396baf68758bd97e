"""drain backfill on local Spark vs. Spark's write.jdbc vs. the in-database INSERT ... SELECT.

Stages the same N jobs (default 1,000,000: ``search.index_annotation`` with
``{"annotation_id": id}``, priority -10, tag ``backfill.bench``) into an empty
``staged_jobs``, three ways, in the same run:

* ``drain backfill``: :func:`drain.spark.backfill.run` from a Parquet copy of
  the records (hash-partitioned on the id, deterministic task ids, one COPY
  transaction per partition with its ledger row);
* ``write.jdbc``: Spark's plain ``DataFrame.write.jdbc`` of the same job
  columns (task ids included), batch size 10,000, into the same table;
* ``INSERT ... SELECT``: one statement in Postgres from the ``annotation``
  table (random task ids), the bulk path of the README.

Each Spark method first runs once on a small input, unmeasured, so that both
measure a warm JVM; then every method runs ``--rounds`` times (each into an
emptied table and ledger) and the best round counts. Every run is checked:
exactly N rows staged. Prints a table and the ratios. ``make bench-spark``.

``--smoke`` (a few thousand rows, one round) checks that the bench works;
``make test`` runs it. The figures mean nothing; it writes
bench/results/spark-smoke.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg

from drain import store
from drain.spark import backfill, mapping, session, sources

RESULTS = Path(__file__).resolve().parent / "results"
ADMIN_URL = os.environ.get("DRAIN_BENCH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
TASK = "search.index_annotation"
M = mapping.Mapping(task_name=TASK, key="id", tag="backfill.bench",
                    kwargs=(("annotation_id", "id"),))


@contextlib.contextmanager
def database() -> Iterator[str]:
    name = f"drain_bench_spark_{os.getpid()}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    url = ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        with psycopg.connect(url) as conn:
            store.migrate(conn)
        yield url
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def empty(url: str) -> None:
    """An empty table and backfill ledger, as after ``drain migrate``: the ledger is part
    of the schema (a backfill refuses a database without it), so it is emptied, not
    dropped."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE staged_jobs, drain_backfill_ledger")
        conn.execute("CHECKPOINT")


def staged(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
        return int(row[0]) if row else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--partitions", type=int,
                        help="drain backfill's write partitions (default: 4 per core, as the CLI)")
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny run (checks the bench works; no figures)")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.rounds = 5000, 1
    n = args.rows
    if session.jdbc_jar() is None:
        print("the Postgres JDBC jar is missing: apt-get install libpostgresql-jdbc-java "
              "(or set DRAIN_SPARK_JDBC_JAR)", file=sys.stderr)
        return 2
    spark, _ = session.get_session(args.master, "drain bench-spark")
    cores = spark.sparkContext.defaultParallelism
    partitions = args.partitions or backfill.default_partitions(spark)
    tmp = tempfile.mkdtemp(prefix="drain-bench-spark-")
    try:
        with database() as url:
            with psycopg.connect(url) as conn:
                conn.execute("CREATE TABLE annotation (id bigint PRIMARY KEY, user_id int)")
                conn.execute("INSERT INTO annotation SELECT i, i %% 1000 "
                             "FROM generate_series(0, %s - 1) i", (n,))
            parquet = os.path.join(tmp, "annotation.parquet")
            spark.range(0, n).selectExpr("id", "CAST(id % 1000 AS int) AS user_id") \
                .write.parquet(parquet)
            small = os.path.join(tmp, "warmup.parquet")
            spark.range(0, min(n, 200_000)).selectExpr("id", "CAST(id % 1000 AS int) AS user_id") \
                .write.parquet(small)
            connection = sources.jdbc_connection(url)

            def run_backfill(path: str) -> None:
                options = backfill.Options(database_url=url, run_id=f"bench-{uuid.uuid4()}",
                                           partitions=partitions)
                backfill.run(spark, spark.read.parquet(path), M, options)

            def run_jdbc(path: str) -> None:
                jobs = mapping.jobs(spark.read.parquet(path), M, f"jdbc-{uuid.uuid4()}", None)
                jobs.selectExpr(
                    "task_id", f"'{TASK}' AS task_name", "args", "kwargs", "'celery' AS queue",
                    f"CAST({M.priority} AS smallint) AS priority", f"'{M.tag}' AS tag",
                ).write.jdbc(
                    connection.url + "?stringtype=unspecified", "staged_jobs", mode="append",
                    properties={**connection.options(), "batchsize": "10000"},
                )

            def run_sql(_: str) -> None:
                with psycopg.connect(url) as conn:
                    conn.execute(
                        "INSERT INTO staged_jobs (task_name, kwargs, priority, tag) "
                        "SELECT %s, jsonb_build_object('annotation_id', id), %s, %s "
                        "FROM annotation",
                        (TASK, M.priority, M.tag),
                    )

            methods: dict[str, Callable[[str], None]] = {
                "drain backfill (COPY per partition, Arrow)": run_backfill,
                "Spark write.jdbc (batchsize 10000)": run_jdbc,
                "in-database INSERT ... SELECT": run_sql,
            }
            print(f"bench-spark: {n:,} rows, master {args.master} ({cores} cores), "
                  f"{partitions} backfill partitions; warming up the JVM...", flush=True)
            for name, method in methods.items():
                if "Spark" in name or "drain" in name:
                    empty(url)
                    method(small)
            best: dict[str, float] = {}
            for round_ in range(1, args.rounds + 1):
                for name, method in methods.items():
                    empty(url)
                    started = time.perf_counter()
                    method(parquet)
                    seconds = time.perf_counter() - started
                    count = staged(url)
                    if count != n:
                        raise SystemExit(f"{name}: staged {count} rows, expected {n}")
                    print(f"  round {round_}: {name:<44} {seconds:7.2f} s "
                          f"{n / seconds:>10,.0f} rows/s", flush=True)
                    best[name] = min(best.get(name, float("inf")), seconds)
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = report(n, best)
    if args.smoke:
        write_smoke_results(n, best, ratio)
    return 0


def report(n: int, best: dict[str, float]) -> float:
    """Prints the table and the ratios; returns drain backfill / write.jdbc."""
    names = list(best)
    backfill_s, jdbc_s, sql_s = (best[name] for name in names)
    print(f"\nbest of the rounds, {n:,} rows:\n")
    print(f"| {'method':<44} | {'seconds':>7} | {'rows/s':>9} | {'vs write.jdbc':>13} |")
    print(f"|{'-' * 46}|{'-' * 8}:|{'-' * 10}:|{'-' * 14}:|")
    for name in names:
        print(f"| {name:<44} | {best[name]:7.2f} | {n / best[name]:9,.0f} | "
              f"{jdbc_s / best[name]:12.2f}x |")
    ratio = jdbc_s / backfill_s
    print(f"\ndrain backfill / write.jdbc: {ratio:.2f}x (target >= 2x: "
          f"{'met' if ratio >= 2 else 'NOT met'}); drain backfill / INSERT ... SELECT: "
          f"{sql_s / backfill_s:.2f}x")
    return ratio


def write_smoke_results(n: int, best: dict[str, float], ratio: float) -> None:
    """bench/results/spark-smoke.json (the full run writes no result file)."""
    summary: list[dict[str, Any]] = [
        {"target": "drain backfill vs Spark write.jdbc", "goal": ">= 2 x write.jdbc",
         "measured": f"{ratio:.2f} x at {n:,} rows (smoke: not a figure)", "met": None},
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "spark-smoke.json"
    path.write_text(json.dumps({
        "name": "spark-smoke", "summary": summary,
        "details": {"rows": n, "best_seconds": {k: round(v, 3) for k, v in best.items()}},
    }, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    sys.exit(main())
