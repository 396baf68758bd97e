"""What bench_spark.py runs on, and its two runs that are not a method comparison.

bench_spark.py (the command) times the three ways to stage N jobs on each master and
prints the figures. This module gives it:

* :func:`database`: a scratch database, migrated, dropped however the bench ends;
* :func:`cluster` and :func:`spark_session`: ``local[*]`` as ``drain backfill`` builds
  it (:func:`drain.spark.session.get_session`), or this process as the driver of a
  standalone cluster (:mod:`tests.spark_cluster.standalone`: a master and two 1-core
  workers on free ports) configured as ``Cluster.submit_argv`` configures
  ``spark-submit``;
* :func:`kill_run`: a backfill during which worker 0's executor JVM is killed (kill -9)
  once about half of its partitions committed, against the same backfill undisturbed;
* :func:`reconcile_run`: ``drain reconcile --stage`` (drain.cli.spark.main, in this
  process, on the active session) of a table against a downstream copy that misses
  1 % of the ids and holds an older version of another 1 %.

Every run is checked: exactly N jobs staged, each record once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import harness
import psycopg

from drain.cli import spark as cli
from drain.spark import backfill, mapping, session
from tests.spark_cluster import standalone

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

APP = "drain bench-spark"
TASK = "search.index_annotation"
M = mapping.Mapping(task_name=TASK, key="id", tag="backfill.bench",
                    kwargs=(("annotation_id", "id"),))
MASTERS = {"local": "local[*]", "cluster": "2 x 1-core workers"}
#: Each worker offers this much; one executor per worker takes EXECUTOR_MEMORY of it.
WORKER_MEMORY, EXECUTOR_MEMORY = "2g", "1536m"
EXECUTORS = 2
RECONCILE_TAG = "reconcile.bench"


# -- the database -------------------------------------------------------------------


@contextlib.contextmanager
def database() -> Iterator[str]:
    """A scratch database, migrated (harness.Setup), dropped however the bench ends."""
    with harness.Setup("spark") as setup:
        yield setup.database(f"drain_bench_spark_{os.getpid()}")


def empty(url: str) -> None:
    """An empty table and backfill ledger, as after ``drain migrate``: the ledger is part
    of the schema (a backfill refuses a database without it), so it is emptied, not
    dropped."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE staged_jobs, drain_backfill_ledger")
        conn.execute("CHECKPOINT")


def one_row(url: str, query: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    with psycopg.connect(url) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return tuple(row)


def staged(url: str) -> int:
    return int(one_row(url, "SELECT count(*) FROM staged_jobs")[0])


def check_each_once(url: str, n: int, what: str) -> None:
    """Exactly ``n`` jobs staged, each record once (one task id per record)."""
    rows, task_ids = one_row(url, "SELECT count(*), count(DISTINCT task_id) FROM staged_jobs")
    if (rows, task_ids) != (n, n):
        raise SystemExit(f"{what}: staged {rows} rows with {task_ids} task ids, expected {n}")


# -- Spark: local[*] or the cluster ----------------------------------------------------


@contextlib.contextmanager
def cluster(root: Path) -> Iterator[standalone.Cluster]:
    """A master and two 1-core workers, stopped (with every executor) however we leave."""
    started = time.perf_counter()
    with standalone.running(root, workers=EXECUTORS, cores=1, memory=WORKER_MEMORY) as running:
        print(f"standalone cluster up at {running.master_url} in "
              f"{time.perf_counter() - started:.1f} s (logs: {root})", flush=True)
        yield running


def executors(spark: SparkSession) -> int:
    """Executors registered with the driver (the driver's own block manager excluded)."""
    status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus()
    return max(0, int(status.size()) - 1)


def wait_for_executors(spark: SparkSession, count: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while (found := executors(spark)) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def cluster_conf() -> dict[str, str]:
    """The configuration ``Cluster.submit_argv`` gives spark-submit, for a driver that is
    this process: the executors run this venv's Python (drain is installed in it)."""
    conf = {
        "spark.pyspark.python": sys.executable,
        "spark.driver.host": standalone.HOST,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "8",
        "spark.executor.memory": EXECUTOR_MEMORY,
        "spark.executor.cores": "1",
    }
    jar = session.jdbc_jar()
    if jar is not None:  # --jars: on the driver's and the executors' class path
        conf["spark.jars"] = str(jar)
    return conf


@contextlib.contextmanager
def spark_session(master: str, running: standalone.Cluster | None) -> Iterator[SparkSession]:
    """A new session on ``master`` ("local" or "cluster"), stopped on the way out."""
    if master == "local":
        spark, _ = session.get_session("local[*]", APP)
    else:
        from pyspark.sql import SparkSession

        assert running is not None
        # A driver in this process: SparkContext hands PYSPARK_PYTHON to the executors.
        os.environ["PYSPARK_PYTHON"] = sys.executable
        builder = SparkSession.builder.appName(APP).master(running.master_url)
        for key, value in cluster_conf().items():
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
    try:
        if master == "cluster":
            found = wait_for_executors(spark, EXECUTORS, 120)
            if found < EXECUTORS:
                raise SystemExit(f"the cluster gave the bench {found} executors, not {EXECUTORS}")
        yield spark
    finally:
        spark.stop()


def run_backfill(spark: SparkSession, url: str, parquet: str, partitions: int,
                 run_id: str | None = None) -> backfill.Result:
    options = backfill.Options(database_url=url, run_id=run_id or f"bench-{uuid.uuid4()}",
                               partitions=partitions)
    return backfill.run(spark, spark.read.parquet(parquet), M, options)


# -- an executor killed half-way ---------------------------------------------------------


@dataclasses.dataclass
class Kill:
    """One backfill with worker 0's executor killed, and the same one without."""

    rows: int
    partitions: int
    undisturbed_seconds: float = 0.0
    seconds: float = 0.0
    #: Partitions committed when the executor was killed (None: the run ended first).
    killed_after: int | None = None
    killed_at_seconds: float | None = None
    #: Seconds until worker 0 ran a new executor (None: not before the run ended).
    relaunched_after: float | None = None
    #: Executors registered with the driver when the run ended, and seconds from the kill
    #: until both were again (None: not within a minute).
    executors_after: int = 0
    executors_back_after: float | None = None
    written: int = 0
    retried_after_commit: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v
                for k, v in dataclasses.asdict(self).items()}


class _Killer(threading.Thread):
    """Polls the ledger; kills worker 0's executor once ``half`` partitions committed,
    then watches the worker start a new one."""

    def __init__(self, running: standalone.Cluster, url: str, run_id: str, half: int,
                 kill: Kill) -> None:
        super().__init__(name="bench-killer", daemon=True)
        self.running, self.url, self.run_id, self.half, self.kill = running, url, run_id, half, kill
        self.started_at = self.killed_at = time.perf_counter()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            killed = self._kill()
            if killed is not None:
                self._watch_relaunch(killed)
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def _kill(self) -> int | None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.done.is_set():
                row = conn.execute("SELECT count(*) FROM drain_backfill_ledger "
                                   "WHERE backfill_id = %s", (self.run_id,)).fetchone()
                committed = int(row[0]) if row else 0
                if committed >= self.half and self.running.executor_pids(0):
                    pid = self.running.kill_executor(0)
                    self.killed_at = time.perf_counter()
                    self.kill.killed_after = committed
                    self.kill.killed_at_seconds = self.killed_at - self.started_at
                    return pid
                self.done.wait(0.05)
        return None

    def _watch_relaunch(self, killed: int) -> None:
        at = time.perf_counter()
        while not self.done.is_set():
            if [pid for pid in self.running.executor_pids(0) if pid != killed]:
                self.kill.relaunched_after = time.perf_counter() - at
                return
            self.done.wait(0.2)


def kill_run(spark: SparkSession, running: standalone.Cluster, url: str, parquet: str, *,
             n: int, partitions: int) -> Kill:
    kill = Kill(rows=n, partitions=partitions)
    empty(url)
    started = time.perf_counter()
    run_backfill(spark, url, parquet, partitions)
    kill.undisturbed_seconds = time.perf_counter() - started
    check_each_once(url, n, "backfill without a kill")
    print(f"  cluster, no kill:       {kill.undisturbed_seconds:7.2f} s "
          f"{n / kill.undisturbed_seconds:>10,.0f} rows/s", flush=True)

    empty(url)
    run_id = f"kill-{uuid.uuid4()}"
    killer = _Killer(running, url, run_id, (partitions + 1) // 2, kill)
    killer.start()
    try:
        result = run_backfill(spark, url, parquet, partitions, run_id)
    finally:
        kill.seconds = time.perf_counter() - killer.started_at
        killer.done.set()
        killer.join(30)
    if killer.error is not None:
        raise SystemExit(f"killing worker 0's executor failed: {killer.error!r}")
    check_each_once(url, n, "backfill with an executor killed")
    ledger = one_row(url, "SELECT count(*), sum(rows) FROM drain_backfill_ledger "
                     "WHERE backfill_id = %s", (run_id,))
    if (ledger[0], ledger[1]) != (partitions, n):
        raise SystemExit(f"backfill with an executor killed: ledger {ledger}, "
                         f"expected ({partitions}, {n})")
    kill.written = result.summary.written
    kill.retried_after_commit = result.summary.retried_after_commit
    kill.executors_after = executors(spark)
    if kill.killed_after is not None and wait_for_executors(spark, EXECUTORS, 60) >= EXECUTORS:
        kill.executors_back_after = time.perf_counter() - killer.killed_at
    when = ("the run ended before half of the partitions committed: nothing killed"
            if kill.killed_after is None else
            f"executor killed after {kill.killed_after}/{partitions} partitions "
            f"({kill.killed_at_seconds:.1f} s)")
    print(f"  cluster, executor kill: {kill.seconds:7.2f} s {n / kill.seconds:>10,.0f} rows/s "
          f"({when}; {kill.executors_after} executor(s) at the end of the run)", flush=True)
    return kill


# -- reconcile ---------------------------------------------------------------------------


@dataclasses.dataclass
class Reconcile:
    master: str
    #: spark.sql.shuffle.partitions: the tasks of each join and aggregation.
    shuffle_partitions: int
    rows: int
    missing: int
    stale: int
    staged: int
    seconds: float
    #: Of which the staging of the repairs (drain's writer, as reported).
    staging_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v
                for k, v in dataclasses.asdict(self).items()}


def residue_count(n: int, residue: int) -> int:
    """How many of the ids 0..n-1 are ``residue`` modulo 100."""
    return max(0, (n - residue + 99) // 100)


def reconcile_tables(url: str, n: int) -> None:
    """``annotation`` (the source of truth: version 2) and ``search_index`` (its
    downstream copy): ids ending in 00 missing, ids ending in 01 at version 1 (stale)."""
    with psycopg.connect(url) as conn:
        conn.execute("DROP TABLE IF EXISTS annotation, search_index")
        conn.execute("CREATE TABLE annotation (id bigint PRIMARY KEY, version int NOT NULL)")
        conn.execute("INSERT INTO annotation SELECT i, 2 FROM generate_series(0, %s - 1) i",
                     (n,))
        conn.execute("CREATE TABLE search_index AS SELECT id AS annotation_id, "
                     "CASE WHEN id % 100 = 1 THEN 1 ELSE version END AS version "
                     "FROM annotation WHERE id % 100 <> 0")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE annotation, search_index")


def reconcile_run(spark: SparkSession, url: str, n: int, master: str) -> Reconcile:
    """``drain reconcile --stage`` on ``spark`` (the active session), checked and timed."""
    empty(url)
    argv = [
        "reconcile", "--database-url", url, "--source", "table:annotation",
        "--partition-column", "id", "--version-column", "version",
        "--downstream-partition-column", "annotation_id",
        "--downstream", "table:search_index", "--downstream-id-column", "annotation_id",
        "--stage", "--task", TASK, "--kwargs", "annotation_id=id", "--tag", RECONCILE_TAG,
        "--id", f"reconcile-{uuid.uuid4()}", "--sample", "3", "--no-progress", "--json",
    ]
    out = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    seconds = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"drain reconcile exited {code} (its error is above)")
    rep = json.loads(out.getvalue().strip().splitlines()[-1])
    missing, stale = residue_count(n, 0), residue_count(n, 1)
    found = (rep["missing"]["count"], rep["stale"]["count"], rep["extra"]["count"], rep["ok"])
    if found != (missing, stale, 0, n - missing - stale):
        raise SystemExit(f"reconcile of {n} rows: (missing, stale, extra, ok) = {found}, "
                         f"expected {(missing, stale, 0, n - missing - stale)}")
    staged_rows = int(rep["staged"]["rows"])
    rows, ids = one_row(url, "SELECT count(*), count(DISTINCT kwargs->>'annotation_id') "
                        "FROM staged_jobs WHERE tag = %s", (RECONCILE_TAG,))
    if not staged_rows == rows == ids == missing + stale:
        raise SystemExit(f"reconcile of {n} rows staged {staged_rows} repairs ({rows} rows, "
                         f"{ids} ids in staged_jobs), expected {missing + stale}")
    shuffle = int(spark.conf.get("spark.sql.shuffle.partitions") or 200)
    result = Reconcile(master=MASTERS[master], shuffle_partitions=shuffle, rows=n,
                       missing=missing, stale=stale, staged=staged_rows, seconds=seconds,
                       staging_seconds=float(rep["staged"]["seconds"]))
    print(f"  {MASTERS[master]}: reconcile {n:,} rows, {missing:,} missing + {stale:,} stale "
          f"staged: {seconds:7.2f} s ({result.staging_seconds:.2f} s staging; {shuffle} shuffle "
          "partitions)", flush=True)
    return result
