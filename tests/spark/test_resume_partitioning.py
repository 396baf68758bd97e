"""A resumed backfill whose key's type changed, and two drivers racing on one id.

* The key's type widens between a failed run and its resume (a CSV read with
  inferSchema gains an id past 2^31; ``ALTER COLUMN id TYPE bigint``): every
  record is staged exactly once (a record's partition is a function of its key's
  text, which int and bigint share). Before: 4,697 of 20,000 twice, 4,646 never.
* Over key types (a first run of each type failed at a resume point chosen from
  the type, then resumed with each type, in a copy of its database): every
  record exactly once, or a one-line refusal with exit code 6
  (PartitioningChanged) and nothing more staged.
* Two drivers on one id, the second started while the first is inside its
  partitions: it adopts the first's partition count (no --partitions) or is
  refused (another explicit --partitions). Before: both staged.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from drain.cli import spark as cli
from drain.errors import DrainError, PartitioningChanged
from drain.spark import backfill, ledger, mapping, writer
from tests import roles, support
from tests.spark import helpers

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

TASK = "search.index_annotation"

#: A row trigger refusing one record: the documented "fix and re-run" case.
_REFUSE = (
    "CREATE FUNCTION refuse_777() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
    "IF NEW.kwargs->>'annotation_id' = '777' THEN RAISE EXCEPTION 'annotation 777 refused'; "
    "END IF; RETURN NEW; END $$",
    "CREATE TRIGGER refuse_777 BEFORE INSERT ON staged_jobs FOR EACH ROW "
    "EXECUTE FUNCTION refuse_777()",
)
_FIXED = ("DROP TRIGGER refuse_777 ON staged_jobs",)


def _staged_keys(db_url: str, run_id: str, keys: list[Any]) -> tuple[int, int, int]:
    """(records of ``keys`` staged twice or more, never staged; other jobs staged)."""
    wanted = {str(mapping.task_id_for(run_id, str(k))) for k in keys}
    counts = Counter(r["task_id"] for r in helpers.staged(db_url))
    twice = sum(1 for t in wanted if counts[t] > 1)
    never = sum(1 for t in wanted if counts[t] == 0)
    return twice, never, sum(n for t, n in counts.items() if t not in wanted)


def test_resume_after_a_csv_key_widens_to_bigint_stages_each_record_once(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "annotations"
    folder.mkdir()
    keys: list[int] = list(range(1, 4001))
    (folder / "a.csv").write_text("id,body\n" + "".join(f"{i},text {i}\n" for i in keys))
    argv = ("backfill", "--database-url", db_url, "--source", f"csv:{folder}", "--task", TASK,
            "--kwargs", "annotation_id=id", "--tag", "backfill.csv", "--id", "widen",
            "--partitions", "8")
    helpers.execute(db_url, *_REFUSE)
    code, _, err = helpers.run(capsys, *argv)
    assert code != 0 and "annotation 777 refused" in err, err
    assert 0 < len(helpers.ledger(db_url, "widen")) < 8
    helpers.execute(db_url, *_FIXED)
    # inferSchema reads id as bigint now.
    (folder / "b.csv").write_text("id,body\n3000000000,text big\n")
    code, _, err = helpers.run(capsys, *argv)
    assert code == 0, err
    # The added record is staged when its partition had not committed (at most once).
    twice, never, added = _staged_keys(db_url, "widen", keys)
    assert (twice, never) == (0, 0)
    assert added <= 1


def test_resume_after_alter_column_type_bigint_stages_each_record_once(
    spark: SparkSession, jdbc: None, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    helpers.execute(
        db_url, "CREATE TABLE annotation (id int PRIMARY KEY, body text)",
        "INSERT INTO annotation SELECT i, 'text ' || i FROM generate_series(1, 4000) i",
    )
    argv = ("backfill", "--database-url", db_url, "--source", "table:annotation", "--task",
            TASK, "--kwargs", "annotation_id=id", "--tag", "backfill.table", "--id", "widen")
    helpers.execute(db_url, *_REFUSE)
    code, _, err = helpers.run(capsys, *argv, "--partitions", "8")
    assert code != 0 and "annotation 777 refused" in err, err
    assert 0 < len(helpers.ledger(db_url, "widen")) < 8
    staged = len(helpers.staged(db_url))
    helpers.execute(db_url, *_FIXED)
    # A key whose text may differ (a text column) is refused, in one line, exit 6.
    helpers.execute(db_url, "ALTER TABLE annotation ALTER COLUMN id TYPE text")
    code, _, err = helpers.run(capsys, *argv)
    assert code == 6
    assert err.count("\n") == 1
    assert "with a key of type int, it is string now" in err
    assert len(helpers.staged(db_url)) == staged
    # bigint keeps every key's text: the resume stages each record once.
    helpers.execute(
        db_url, "ALTER TABLE annotation ALTER COLUMN id TYPE bigint USING id::bigint",
        "INSERT INTO annotation VALUES (3000000000, 'big')",
    )
    code, _, err = helpers.run(capsys, *argv)
    assert code == 0, err
    twice, never, added = _staged_keys(db_url, "widen", list(range(1, 4001)))
    assert (twice, never) == (0, 0)
    assert added <= 1
    code, out, _ = helpers.run(capsys, *argv)
    assert (code, "already complete" in out) == (0, True)


#: Each key type, as an expression over spark.range's id.
_TYPES = {
    "int": "CAST(id AS INT)",
    "bigint": "id",
    "decimal(20,0)": "CAST(id AS DECIMAL(20,0))",
    "string": "CAST(id AS STRING)",
    "date": "date_add(DATE'2000-01-01', CAST(id AS INT))",
}
#: Each (first, then) pair; a first type's cases share a worker (xdist_group), where
#: its failed first run is made once.
_PAIRS = [pytest.param(a, b, id=f"{a}->{b}", marks=pytest.mark.xdist_group(f"resume-{a}"))
          for a in _TYPES for b in _TYPES]
_N = 200
_TYPES_MAPPING = mapping.Mapping(task_name=TASK, key="id", tag="backfill.types",
                                 kwargs=(("annotation_id", "id"),))


def _source(spark: SparkSession, kind: str) -> Any:
    return spark.range(0, _N).selectExpr(f"{_TYPES[kind]} AS id")


@pytest.fixture(scope="module")
def failed_first_run(
    spark: SparkSession, template_db: str
) -> Iterator[Callable[[str], tuple[str, int]]]:
    """``(database, jobs staged)`` after a first run with keys of one type failed at
    one partition (its resume point, from the type): made once per type and worker,
    and kept as the template each case of that type copies."""
    made: dict[str, tuple[str, int]] = {}
    with contextlib.ExitStack() as stack:
        def get(first: str) -> tuple[str, int]:
            if first not in made:
                name = support.unique("drain_kt")
                url = stack.enter_context(support.database(name, template_db))
                resume_point = random.Random(first).randrange(4)
                options = backfill.Options(database_url=url, run_id="types", partitions=4,
                                           faults=(writer.Fault(resume_point, "before_commit",
                                                                attempts=99),))
                with pytest.raises(DrainError, match="InjectedFault"), cli.spark_errors():
                    backfill.run(spark, _source(spark, first), _TYPES_MAPPING, options)
                assert resume_point not in helpers.ledger(url, "types")
                made[first] = (name, len(helpers.staged(url)))
            return made[first]

        yield get


@pytest.mark.parametrize(("first", "then"), _PAIRS)
def test_resume_over_key_types_stages_each_record_once_or_is_refused(
    spark: SparkSession, failed_first_run: Callable[[str], tuple[str, int]], first: str,
    then: str,
) -> None:
    template, before = failed_first_run(first)
    with support.database(support.unique("drain_t"), template) as db_url:
        assert len(helpers.staged(db_url)) == before
        keys = [r["id"] for r in _source(spark, first).collect()]
        if ledger.key_identity(first) != ledger.key_identity(then):
            refused = re.escape(f"key of type {first}, it is {then}")
            with pytest.raises(PartitioningChanged, match=refused):
                backfill.run(spark, _source(spark, then), _TYPES_MAPPING,
                             backfill.Options(db_url, "types", 4))
            assert len(helpers.staged(db_url)) == before
            return
        result = backfill.run(spark, _source(spark, then), _TYPES_MAPPING,
                              backfill.Options(db_url, "types", 4))
        assert result.summary.rows == _N - before
        assert _staged_keys(db_url, "types", keys) == (0, 0, 0)


def _waiting_on(db_url: str, lock: int) -> int:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s "
            "AND NOT granted", (lock,),
        ).fetchone()
    return int(row[0]) if row else 0


def _runs(db_url: str) -> int:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(DISTINCT run_token) FROM drain_backfill_attempts").fetchone()
    return int(row[0]) if row else 0


@pytest.mark.slow  # three drivers, each a JVM of its own
def test_two_drivers_with_different_partition_counts_stage_each_record_once(
    spark: SparkSession, db_url: str, tmp_path: Path, spawn: Any
) -> None:
    path = str(tmp_path / "annotations.parquet")
    spark.range(0, 2000).write.parquet(path)
    lock = 4242
    # Every COPY waits on an advisory lock the test holds: the first driver stays inside
    # its partitions (their ledger rows claimed, uncommitted) until the test lets go.
    helpers.execute(
        db_url,
        "CREATE FUNCTION hold() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"PERFORM pg_advisory_xact_lock_shared({lock}); RETURN NULL; END $$",
        "CREATE TRIGGER hold BEFORE INSERT ON staged_jobs FOR EACH STATEMENT "
        "EXECUTE FUNCTION hold()",
    )
    argv = ("backfill", "--database-url", db_url, "--source", f"parquet:{path}", "--task",
            TASK, "--kwargs", "annotation_id=id", "--tag", "backfill.race", "--id", "race")
    env = support.drain_env(db_url, roles.ADMIN, DRAIN_SPARK_MASTER="local[2]")
    with psycopg.connect(db_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (lock,))
        first = spawn(support.drain_argv(*argv, "--partitions", "8"), env, "first")
        support.wait_for(lambda: _waiting_on(db_url, lock) or first.proc.poll() is not None,
                         180, "the first driver inside its first partition")
        assert first.proc.poll() is None, first.output()
        # No --partitions, and 4 per core of local[3] is 12: it adopts the id's 8.
        second = spawn(support.drain_argv(*argv, "--master", "local[3]", "--json"), env,
                       "second")
        support.wait_for(lambda: _runs(db_url) >= 2 or second.proc.poll() is not None, 180,
                         "the second driver's partitions")
        # An explicit other count is refused, before any partition.
        third = support.run_cli(db_url, *argv, "--partitions", "12", timeout=180,
                                env=support.drain_env(db_url, roles.ADMIN))
        assert third.returncode == 2, third.stderr
        assert "started with 8 partitions" in third.stderr
        holder.execute("SELECT pg_advisory_unlock(%s)", (lock,))
    assert first.wait(180) == 0, first.output()
    assert second.wait(180) == 0, second.output()
    assert '"partitions": 8' in second.output()
    assert _staged_keys(db_url, "race", list(range(2000))) == (0, 0, 0)
    with psycopg.connect(db_url) as conn:
        counts = conn.execute(
            "SELECT DISTINCT partitions FROM drain_backfill_ledger WHERE backfill_id = 'race'"
        ).fetchall()
    assert counts == [(8,)]
