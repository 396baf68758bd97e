"""``drain backfill`` and ``drain reconcile`` on a real standalone cluster.

* Submitted with ``spark-submit --master spark://...`` exactly as docs/spark.md
  shows (drain in ``drain.zip`` on ``--py-files``, made by ``python -m
  drain.spark.bundle``): the executors import drain from that zip, and both
  commands stage what they do locally.
* kill -9 of one worker's executor JVM, and in another test of the whole
  worker (with its executor and Python workers), while a backfill of
  1,000,000 records is writing: Spark reschedules the lost tasks, the run
  finishes, every record is staged exactly once (count, and every key once
  with its task id) and the ledger holds each partition once.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psycopg
import pytest

from tests import support
from tests.spark import helpers
from tests.spark_cluster import standalone, submit

pytestmark = [pytest.mark.spark_cluster, pytest.mark.timeout(600)]

TASK = submit.TASK
BIG = 1_000_000


def test_submitted_backfill_and_reconcile_run_on_the_cluster(
    workers: standalone.Cluster, bundle_dir: Path, db_url: str, tmp_path: Path
) -> None:
    # The executors run the drain of the zip, not the one installed on the "nodes".
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from pyspark.sql import SparkSession\n"
        "spark = SparkSession.builder.getOrCreate()\n"
        "where = spark.sparkContext.parallelize(range(4), 4).map(\n"
        "    lambda _: __import__('drain').__file__).collect()\n"
        "print(sorted(set(where)))\n"
        "spark.stop()\n"
    )
    argv = workers.submit_argv(bundle_dir)
    done = subprocess.run([*argv[:-1], str(probe)], capture_output=True, text=True,
                          timeout=240, check=False, cwd=tmp_path, env=workers.env,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "['./drain.zip/drain/__init__.py']"

    path = submit.parquet(tmp_path / "records", 20_000)
    log = tmp_path / "backfill.log"
    started = time.monotonic()
    result = submit.finish(submit.submit(
        workers, bundle_dir, db_url, log, "backfill", "--source", f"parquet:{path}",
        "--task", TASK, "--kwargs", "annotation_id=id", "--tag", "backfill.cluster",
    ), log)
    # Default partitions: 4 per core of the cluster's two 1-core executors.
    assert (result["rows"], result["partitions"], result["written"]) == (20_000, 8, 8)
    submit.assert_every_key_once(db_url, "backfill.cluster", 20_000, 8)
    print(f"backfill submitted and finished in {time.monotonic() - started:.1f}s")

    helpers.execute(
        db_url,
        "CREATE TABLE annotation (id bigint PRIMARY KEY, version int NOT NULL DEFAULT 1)",
        "INSERT INTO annotation (id) SELECT generate_series(1, 5000)",
        "CREATE TABLE search_index AS SELECT id AS annotation_id, version FROM annotation "
        "WHERE id % 100 <> 0",
        "UPDATE annotation SET version = 2 WHERE id % 250 = 1",
    )
    log = tmp_path / "reconcile.log"
    started = time.monotonic()
    report = submit.finish(submit.submit(
        workers, bundle_dir, db_url, log, "reconcile", "--source", "table:annotation",
        "--version-column", "version", "--downstream", "table:search_index",
        "--downstream-id-column", "annotation_id", "--stage", "--task", TASK,
        "--kwargs", "annotation_id=id", "--tag", "reconcile.cluster", "--id", "repair-1",
    ), log)
    print(f"reconcile submitted and finished in {time.monotonic() - started:.1f}s")
    missing, stale = report["missing"], report["stale"]
    assert isinstance(missing, dict) and isinstance(stale, dict)
    assert (missing["count"], stale["count"]) == (50, 20)
    staged = report["staged"]
    assert isinstance(staged, dict) and staged["rows"] == 70
    assert len(helpers.staged(db_url, "reconcile.cluster")) == 70


def _kill_while_writing(cluster: standalone.Cluster, bundle_dir: Path, db_url: str,
                        tmp_path: Path, kill: str) -> dict[str, object]:
    """A 1,000,000-record backfill in 16 partitions; once some partitions committed and
    others are being written, ``kill`` worker 0's executor or the whole worker."""
    path = submit.parquet(tmp_path / "records", BIG)
    run_id = f"kill-{kill}"
    log = tmp_path / "backfill.log"
    proc = submit.submit(cluster, bundle_dir, db_url, log, "backfill",
                         "--source", f"parquet:{path}", "--task", TASK,
                         "--kwargs", "annotation_id=id", "--tag", "backfill.kill",
                         "--id", run_id, "--partitions", "16")
    try:
        support.wait_for(
            lambda: submit.committed(db_url, run_id) >= 3 or proc.poll() is not None, 240,
            "3 committed partitions",
        )
        assert proc.poll() is None, "the backfill ended before the kill"
        assert cluster.executor_pids(0), "worker0 runs no executor"
        if kill == "executor":
            cluster.kill_executor(0)
        else:
            cluster.kill_worker(0)
        killed_at = submit.committed(db_url, run_id)
        started = time.monotonic()
    except BaseException:
        proc.kill()
        raise
    assert killed_at < 16, "every partition had committed before the kill"
    result = submit.finish(proc, log)
    print(f"{kill} killed after {killed_at}/16 partitions; the run finished "
          f"{time.monotonic() - started:.1f}s later: {result}")
    assert result["rows"] == BIG
    submit.assert_every_key_once(db_url, run_id, BIG, 16)
    _assert_attempts_told_apart(db_url, run_id)
    return result


def _assert_attempts_told_apart(db_url: str, run_id: str) -> None:
    """Every attempt has its own Spark task id, also where a lost executor's shuffle
    output made Spark attempt the stage again and attemptNumber() restarted at 0."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT partition, attempt, task_attempt_id FROM drain_backfill_attempts "
            "WHERE backfill_id = %s", (run_id,),
        ).fetchall()
    ids = [tid for _, _, tid in rows]
    assert None not in ids and len(set(ids)) == len(ids), rows
    again = len(rows) - len({(p, a) for p, a, _ in rows})
    print(f"{len(rows)} attempts; {again} shared their partition and attemptNumber with "
          "another (a new stage attempt)")


def test_executor_killed_while_writing(
    workers: standalone.Cluster, bundle_dir: Path, db_url: str, tmp_path: Path
) -> None:
    _kill_while_writing(workers, bundle_dir, db_url, tmp_path, "executor")


def test_worker_killed_while_writing(
    workers: standalone.Cluster, bundle_dir: Path, db_url: str, tmp_path: Path
) -> None:
    _kill_while_writing(workers, bundle_dir, db_url, tmp_path, "worker")
    assert not workers.workers[0].alive()
