"""What a backfill says when what it runs on goes away mid-run: one line, its exit code.

``python -m drain.spark backfill`` runs in its own process and its own local
Spark (``local[2]``: a failed task is not retried). Each partition's COPY waits
on an advisory lock the test holds (a statement trigger on staged_jobs), so the
test acts while both partitions are inside their transaction:

* Postgres terminates the partitions' connections: exit 3 (database
  unavailable) with one line naming the database and what to do, nothing staged.
* The Spark JVM the driver started is killed: exit 1 with one line naming the
  Spark JVM as lost (not the database), no py4j traceback, nothing staged.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from drain.spark import task
from tests import roles, support
from tests.spark import helpers

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

_LOCK = 26_0026
_BLOCK_COPY = f"""
CREATE FUNCTION drain_test_block() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_advisory_xact_lock_shared({_LOCK}); RETURN NULL; END $$;
CREATE TRIGGER drain_test_block BEFORE INSERT ON staged_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION drain_test_block();
"""
_PARTITIONS = "application_name LIKE 'drain backfill %%' AND datname = current_database()"


@pytest.fixture
def blocked(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A session holding the lock every partition's COPY waits on."""
    helpers.execute(db_url, _BLOCK_COPY)
    with psycopg.connect(db_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (_LOCK,))
        yield holder


def _in_copy(spark: SparkSession, db_url: str, tmp_path: Path, blocked: psycopg.Connection[Any],
             spawn: Callable[..., support.Process]) -> support.Process:
    """The backfill started, once both its partitions wait in their COPY."""
    path = str(tmp_path / "records.parquet")
    spark.range(0, 200).write.parquet(path)
    env = {**support.drain_env(db_url, roles.ADMIN), "DRAIN_SPARK_MASTER": "local[2]"}
    argv = [sys.executable, "-m", "drain.spark", "backfill", "--source", f"parquet:{path}",
            "--task", "search.index_annotation", "--kwargs", "annotation_id=id",
            "--tag", "backfill.lost", "--partitions", "2", "--no-progress"]
    proc = spawn(argv, env, "backfill")
    support.wait_for(lambda: _waiting(blocked, proc) == 2, 180, "both partitions in their COPY")
    return proc


def _waiting(conn: psycopg.Connection[Any], proc: support.Process) -> int:
    if proc.proc.poll() is not None:
        raise AssertionError(f"the backfill exited early:\n{proc.output()}")
    row = conn.execute(f"SELECT count(*) FROM pg_stat_activity WHERE {_PARTITIONS} "
                       "AND wait_event = 'advisory'").fetchone()
    return int(row[0]) if row else 0


def _drained(db_url: str) -> bool:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(f"SELECT count(*) FROM pg_stat_activity WHERE {_PARTITIONS}").fetchone()
    return row is not None and row[0] == 0


#: What the JVM prints while it starts, before drain can set its log level.
_JVM_START = re.compile(r"WARNING: Using incubator|Using Spark's default log4j|Setting default "
                        r"log level|To adjust logging level|\d\d/\d\d/\d\d [\d:]+ WARN ")


def _lines(output: str) -> list[str]:
    """The process's output but for the JVM's start-up lines."""
    return [line for line in output.splitlines() if line.strip() and not _JVM_START.match(line)]


@pytest.mark.slow  # a backfill process: a JVM of its own
def test_postgres_terminating_the_partitions_connections_exits_3(
    spark: SparkSession, db_url: str, tmp_path: Path, blocked: psycopg.Connection[Any],
    spawn: Callable[..., support.Process],
) -> None:
    proc = _in_copy(spark, db_url, tmp_path, blocked, spawn)
    blocked.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {_PARTITIONS}")
    assert proc.wait(180) == 3, proc.output()
    lines = _lines(proc.output())
    assert len(lines) == 1, proc.output()
    assert lines[0].startswith("drain: error: Postgres closed partition "), lines
    assert "'s connection (terminating connection due to administrator command); nothing of " \
        "it was staged; re-run with the same --id to stage the partitions that did not " \
        "commit" in lines[0], lines
    assert helpers.staged(db_url) == []
    assert helpers.ledger(db_url, "backfill.lost") == {}


def _java_child(pid: int) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and comm == "java":
            return int(entry)
    return None


@pytest.mark.slow  # a backfill process: a JVM of its own
def test_the_spark_jvm_dying_is_one_line_naming_it(
    spark: SparkSession, db_url: str, tmp_path: Path, blocked: psycopg.Connection[Any],
    spawn: Callable[..., support.Process],
) -> None:
    proc = _in_copy(spark, db_url, tmp_path, blocked, spawn)
    java = _java_child(proc.pid)
    assert java is not None, "the driver's JVM is not its child"
    os.kill(java, signal.SIGKILL)
    # Let the partitions go on once the JVM has exited (its main thread a zombie,
    # possibly before its children are reparented): from then on a writer must
    # see its feeder gone (drain.spark.task.feeder) and commit nothing.
    support.wait_for(lambda: task.exited(java), 60, "the killed JVM to exit")
    blocked.execute("SELECT pg_advisory_unlock(%s)", (_LOCK,))
    assert proc.wait(180) == 1, proc.output()
    lines = _lines(proc.output())
    assert len(lines) == 1, proc.output()
    assert lines[0].startswith("drain: error: lost the Spark JVM: the Java process "), lines
    assert "refused" not in lines[0] and "database" not in lines[0], lines
    # Its Python workers, orphaned, commit nothing.
    support.wait_for(lambda: _drained(db_url), 120, "the orphaned partitions to end")
    assert helpers.staged(db_url) == []
    assert helpers.ledger(db_url, "backfill.lost") == {}
