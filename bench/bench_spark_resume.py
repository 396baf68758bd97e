"""What a resumed backfill costs: the whole run, a resume of one missing partition, and
a fresh run of just that partition's records, on local Spark, in one run.

    python bench/bench_spark_resume.py [--rows 200000] [--partitions 8] [--rounds 3]

A backfill of ``--rows`` records (Parquet) commits every partition; then, each
round, one partition's ledger row and jobs are deleted (as if it had failed)
and the backfill is run again with the same id: it must stage exactly that
partition's records. The baseline is what those records cost on their own: a
backfill, under a new id, of a source holding only them (written beforehand).
A resume "costs what its missing partitions cost" when the two are close; the
whole run is printed for scale. Best of ``--rounds``. ``make bench-spark``
runs it after bench_spark.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid

import psycopg
from spark_cluster_bench import M, database

from drain.spark import backfill, session


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--master", default="local[*]")
    args = parser.parse_args()
    n, parts, missing = args.rows, args.partitions, 3
    spark, _ = session.get_session(args.master, "drain bench-spark-resume")
    tmp = tempfile.mkdtemp(prefix="drain-bench-resume-")
    try:
        with database() as url:
            whole = os.path.join(tmp, "whole.parquet")
            only = os.path.join(tmp, "only.parquet")
            spark.range(0, n).write.parquet(whole)
            spark.read.parquet(whole).filter(  # drain.spark.mapping.partition_of
                f"pmod(hash(CAST(id AS string)), {parts}) = {missing}").write.parquet(only)
            expected = spark.read.parquet(only).count()

            def run(path: str, run_id: str) -> tuple[float, int]:
                options = backfill.Options(database_url=url, run_id=run_id, partitions=parts)
                started = time.perf_counter()
                result = backfill.run(spark, spark.read.parquet(path), M, options)
                return time.perf_counter() - started, result.summary.rows

            run(whole, "warm-up")  # a warm JVM for every measured run
            first, rows = run(whole, "resumed")
            assert rows == n, rows
            resumes, alone = [], []
            for round_ in range(args.rounds):
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute("DELETE FROM drain_backfill_ledger "
                                 "WHERE backfill_id = 'resumed' AND partition = %s", (missing,))
                seconds, rows = run(whole, "resumed")
                assert rows == expected, (rows, expected)
                resumes.append(seconds)
                seconds, rows = run(only, f"alone-{uuid.uuid4()}")
                assert rows == expected, (rows, expected)
                alone.append(seconds)
                print(f"round {round_ + 1}: resume {resumes[-1]:.2f} s, the partition's records "
                      f"alone {alone[-1]:.2f} s", file=sys.stderr)
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nresume of 1 missing partition of {parts} ({expected:,} of {n:,} records), "
          f"{args.master}, best of {args.rounds}:\n")
    print("| run | seconds |\n|---|--:|")
    print(f"| the whole backfill ({n:,} records, first run) | {first:.2f} |")
    print(f"| resume: the same backfill again, 1 partition missing | {min(resumes):.2f} |")
    print(f"| the missing partition's {expected:,} records alone | {min(alone):.2f} |")
    print(f"\nresume / the records alone = {min(resumes) / min(alone):.2f}; "
          f"resume / whole run = {min(resumes) / first:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
