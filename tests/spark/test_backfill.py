"""``drain backfill`` on local Spark against the real Postgres.

* From Parquet and from a Postgres table or query read in parallel over JDBC,
  every record is staged exactly once, with its deterministic task id, its
  args/kwargs, the low default priority and the tag.
* A partition that fails after its commit is retried by Spark and stages
  nothing the second time; one that fails before its commit leaves nothing
  and is staged by the retry. (Both on the Arrow and the row writer.)
* A re-run with the same id stages only the partitions that never committed;
  a re-run of a complete backfill stages nothing; a different partition
  count is refused.
* Rows that reach a partition their key does not hash to fail the partition
  instead of being staged.
* --dry-run stages nothing; errors are one line with drain's exit codes.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from drain.cli import spark as cli
from drain.errors import DrainError
from drain.spark import backfill, ledger, mapping, task, writer
from tests import support
from tests.spark import helpers

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

TASK = "search.index_annotation"


def _parquet(spark: SparkSession, tmp_path: Path, n: int) -> str:
    path = str(tmp_path / "annotations.parquet")
    spark.range(0, n).selectExpr("id", "id % 7 AS user_id").write.parquet(path)
    return path


def _annotations(db_url: str, n: int) -> None:
    helpers.execute(
        db_url,
        "CREATE TABLE annotation (id bigint PRIMARY KEY, user_id int NOT NULL, body text)",
        f"INSERT INTO annotation SELECT i, i % 7, 'text ' || i FROM generate_series(1, {n}) i",
    )


def _assert_each_once(db_url: str, run_id: str, keys: list[int], tag: str) -> None:
    rows = helpers.staged(db_url, tag)
    assert len(rows) == len(keys)
    by_id = {r["task_id"]: r for r in rows}
    assert set(by_id) == {str(mapping.task_id_for(run_id, str(k))) for k in keys}
    assert sorted(r["kwargs"]["annotation_id"] for r in rows) == sorted(keys)
    assert sum(helpers.ledger(db_url, run_id).values()) == len(keys)


def test_backfill_from_parquet_stages_every_record_once(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _parquet(spark, tmp_path, 1000)
    result = helpers.run_json(
        capsys, "backfill", "--database-url", db_url, "--source", f"parquet:{path}",
        "--task", TASK, "--kwargs", "annotation_id=id", "--tag", "backfill.reindex",
        "--partitions", "5",
    )
    assert result["rows"] == 1000
    assert (result["partitions"], result["written"], result["skipped_earlier_run"]) == (5, 5, 0)
    _assert_each_once(db_url, "backfill.reindex", list(range(1000)), "backfill.reindex")
    rows = helpers.staged(db_url)
    assert {(r["task_name"], r["queue"], r["priority"]) for r in rows} == {(TASK, None, -10)}
    assert all(r["args"] == [] and r["not_before"] is None for r in rows)
    assert len(helpers.ledger(db_url, "backfill.reindex")) == 5


def test_backfill_from_a_jdbc_table_read_in_parallel(
    spark: SparkSession, jdbc: None, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from drain.spark import sources

    _annotations(db_url, 2000)
    options = sources.JdbcOptions(database_url=db_url, partition_column="id", num_partitions=3)
    assert sources.read(spark, sources.Source.parse("table:annotation"),
                        options).rdd.getNumPartitions() == 3
    result = helpers.run_json(
        capsys, "backfill", "--database-url", db_url, "--source", "table:annotation",
        "--partition-column", "id", "--read-partitions", "3", "--where", "user_id = 3",
        "--task", TASK, "--args-expr", "array(body)", "--kwargs", "annotation_id=id,user_id",
        "--tag", "backfill.user3", "--id", "user3-v1", "--queue", "reindex", "--priority", "-20",
        "--partitions", "4",
    )
    keys = [i for i in range(1, 2001) if i % 7 == 3]
    assert result["rows"] == len(keys)
    _assert_each_once(db_url, "user3-v1", keys, "backfill.user3")
    for row in helpers.staged(db_url):
        annotation_id = row["kwargs"]["annotation_id"]
        assert row["kwargs"] == {"annotation_id": annotation_id, "user_id": 3}
        assert row["args"] == [f"text {annotation_id}"]
        assert (row["queue"], row["priority"]) == ("reindex", -20)


def test_backfill_from_a_query(
    spark: SparkSession, jdbc: None, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _annotations(db_url, 300)
    result = helpers.run_json(
        capsys, "backfill", "--database-url", db_url,
        "--source", "query:SELECT id FROM annotation WHERE id % 10 = 0",
        "--task", TASK, "--kwargs", "annotation_id=id", "--tag", "backfill.tens",
        "--partitions", "3",
    )
    assert result["rows"] == 30
    _assert_each_once(db_url, "backfill.tens", list(range(10, 301, 10)), "backfill.tens")


def _options(db_url: str, run_id: str, *faults: writer.Fault, arrow: bool = True,
             partitions: int = 4) -> backfill.Options:
    return backfill.Options(database_url=db_url, run_id=run_id, partitions=partitions,
                            arrow=arrow, faults=faults)


M = mapping.Mapping(task_name=TASK, key="id", tag="backfill.faults",
                    kwargs=(("annotation_id", "id"),))


@pytest.mark.parametrize("arrow", [True, False], ids=["arrow", "rows"])
def test_partition_failing_after_its_commit_is_not_staged_again(
    spark: SparkSession, db_url: str, arrow: bool
) -> None:
    df = spark.range(0, 400)
    faults = (writer.Fault(1, "after_commit"), writer.Fault(3, "after_commit"))
    result = backfill.run(spark, df, M, _options(db_url, "after", *faults, arrow=arrow))
    # Spark retried both partitions; the retries found their ledger rows and staged nothing.
    assert result.summary.retried_after_commit == 2
    assert result.summary.rows == 400
    # Each retry is on record, and the run reports it.
    attempts = result.summary.attempts
    assert (attempts.total, attempts.extra, attempts.partitions_retried) == (6, 2, 2)
    assert (attempts.found_committed, attempts.failed, attempts.unheard) == (2, 0, 0)
    assert "2 partition(s) took 2 more Spark attempt(s)" in result.text()
    _assert_each_once(db_url, "after", list(range(400)), "backfill.faults")


@pytest.mark.parametrize("arrow", [True, False], ids=["arrow", "rows"])
def test_partition_failing_before_its_commit_leaves_nothing_and_is_retried(
    spark: SparkSession, db_url: str, arrow: bool
) -> None:
    df = spark.range(0, 400)
    result = backfill.run(spark, df, M, _options(
        db_url, "before", writer.Fault(0, "before_commit"), writer.Fault(2, "before_commit"),
        arrow=arrow,
    ))
    assert result.summary.retried_after_commit == 0
    assert (result.summary.rows, result.summary.written) == (400, 4)
    attempts = result.summary.attempts
    assert (attempts.total, attempts.extra, attempts.partitions_retried) == (6, 2, 2)
    assert (attempts.failed, attempts.found_committed, attempts.unheard) == (2, 0, 0)
    assert "only one attempt of each committed (2 failed)" in result.text()
    _assert_each_once(db_url, "before", list(range(400)), "backfill.faults")


def test_rerun_with_the_same_id_stages_only_what_never_committed(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _parquet(spark, tmp_path, 600)
    df = spark.read.parquet(path)
    m = mapping.Mapping(task_name=TASK, key="id", tag="backfill.rerun",
                        kwargs=(("annotation_id", "id"),))
    # Partition 2 fails on every attempt: Spark gives up and the run fails.
    with pytest.raises(DrainError, match="InjectedFault: injected failure before_commit in "
                                         "partition 2"), cli.spark_errors():
        backfill.run(spark, df, m, _options(
            db_url, "rerun", writer.Fault(2, "before_commit", attempts=99)
        ))
    committed = helpers.ledger(db_url, "rerun")
    assert sorted(committed) == [0, 1, 3]
    assert len(helpers.staged(db_url)) == sum(committed.values()) < 600

    argv = ("backfill", "--database-url", db_url, "--source", f"parquet:{path}", "--task", TASK,
            "--kwargs", "annotation_id=id", "--tag", "backfill.rerun", "--id", "rerun")
    # --dry-run counts what the run would stage given the ledger (before: all 600).
    dry = helpers.run_json(capsys, *argv, "--dry-run", "--sample", "0")
    assert (dry["count"], dry["committed_partitions"]) == (600 - sum(committed.values()), 3)
    second = helpers.run_json(capsys, *argv)  # --partitions: the ledger's 4
    assert second["partitions"] == 4
    assert (second["written"], second["skipped_earlier_run"]) == (1, 3)
    assert second["rows"] == 600 - sum(committed.values())
    # A resume costs what its missing partition costs: the committed partitions' records
    # were dropped as they were read, and their tasks never connected.
    assert second["attempts"]["total"] == 1
    _assert_each_once(db_url, "rerun", list(range(600)), "backfill.rerun")

    third = helpers.run_json(capsys, *argv)
    assert third["already_complete"] is True
    assert third["rows"] == 0
    assert len(helpers.staged(db_url)) == 600
    code, out, _ = helpers.run(capsys, *argv)
    assert code == 0
    assert "already complete" in out
    code, out, _ = helpers.run(capsys, *argv, "--dry-run")
    assert (code, out) == (0, "dry run: backfill 'rerun' would stage 0 job(s) in 4 partitions "
                              "(4 committed by earlier runs with 600 job(s), skipped)\n")


def test_rerun_with_another_partition_count_is_refused(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _parquet(spark, tmp_path, 50)
    argv = ("backfill", "--database-url", db_url, "--source", f"parquet:{path}", "--task", TASK,
            "--tag", "backfill.count")
    assert helpers.run(capsys, *argv, "--partitions", "4")[0] == 0
    code, _, err = helpers.run(capsys, *argv, "--partitions", "5")
    assert code == 2
    assert err.count("\n") == 1
    assert "started with 4 partitions" in err
    assert "--partitions 4" in err
    assert len(helpers.staged(db_url)) == 50


@pytest.mark.parametrize("arrow", [True, False], ids=["arrow", "rows"])
def test_rows_in_the_wrong_partition_fail_instead_of_being_staged(
    spark: SparkSession, db_url: str, arrow: bool
) -> None:
    ledger.prepare(db_url, "misplaced", ledger.Partitioning(4, "id", "bigint"))
    jobs = mapping.jobs(spark.range(0, 200), M, "misplaced", 4).repartition(4)  # round robin
    config = writer.WriterConfig(db_url, "misplaced", 4, run_token=str(uuid.uuid4()))
    with pytest.raises(DrainError, match=r"PartitioningError: a row of partition \d reached "
                                         r"partition \d"), cli.spark_errors():
        writer.write(mapping.copy_lines(jobs, M), config, arrow=arrow)
    assert helpers.staged(db_url) == []
    assert helpers.ledger(db_url, "misplaced") == {}


@pytest.mark.parametrize("arrow", [True, False], ids=["arrow", "rows"])
def test_a_partition_receiving_fewer_records_than_counted_commits_nothing(
    spark: SparkSession, db_url: str, arrow: bool
) -> None:
    ledger.prepare(db_url, "short", ledger.Partitioning(4, "id", "bigint"))
    df = spark.range(0, 200)
    expected = writer.expected_rows(df, M.key, 4)
    assert sum(expected.values()) == 200
    expected[1] += 1  # as if a record of partition 1 never reached its writer
    config = writer.WriterConfig(db_url, "short", 4, run_token=str(uuid.uuid4()),
                                 expected=expected)
    with pytest.raises(DrainError, match=r"InputCutShortError: partition 1: received \d+ of its "
                                         r"\d+ records"), cli.spark_errors():
        writer.write(mapping.copy_lines(mapping.jobs(df, M, "short", 4), M), config, arrow=arrow)
    assert 1 not in helpers.ledger(db_url, "short")


def test_dry_run_prints_count_and_sample_and_stages_nothing(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _parquet(spark, tmp_path, 100)
    argv = ("backfill", "--database-url", db_url, "--source", f"parquet:{path}", "--task", TASK,
            "--kwargs", "annotation_id=id", "--tag", "backfill.dry", "--where", "id >= 10",
            "--dry-run", "--sample", "3")
    code, out, _ = helpers.run(capsys, *argv)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("dry run: backfill 'backfill.dry' would stage 90 job(s) in 8 "
                        "partitions; the first 3 by key:")
    sample = [json.loads(line) for line in lines[1:]]
    assert [job["kwargs"] for job in sample] == [{"annotation_id": i} for i in (10, 11, 12)]
    assert [job["task_id"] for job in sample] == [
        str(mapping.task_id_for("backfill.dry", str(i))) for i in (10, 11, 12)
    ]
    as_json = helpers.run_json(capsys, *argv)
    assert (as_json["dry_run"], as_json["count"]) == (True, 90)
    assert helpers.staged(db_url) == []
    assert helpers.ledger(db_url, "backfill.dry") == {}


def test_missing_schema_exits_4(
    spark: SparkSession, empty_db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _parquet(spark, tmp_path, 10)
    code, _, err = helpers.run(
        capsys, "backfill", "--database-url", empty_db_url, "--source", f"parquet:{path}",
        "--task", TASK, "--tag", "backfill.x",
    )
    assert code == 4
    assert "run `drain migrate` first" in err


def test_unreachable_database_exits_3(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _parquet(spark, tmp_path, 10)
    url = f"postgresql://drain:secret@127.0.0.1:{support.free_port()}/nowhere"
    code, _, err = helpers.run(
        capsys, "backfill", "--database-url", url, "--source", f"parquet:{path}",
        "--task", TASK, "--tag", "backfill.x", "--partitions", "2",
    )
    assert code == 3
    assert err.startswith("drain: error: database postgresql://drain:***@127.0.0.1:")
    assert "secret" not in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "case",
    [
        (("--kwargs", "annotation_id=nope"), "drain: error: Spark: [UNRESOLVED_COLUMN"),
        (("--key", "CASE WHEN id = 3 THEN NULL ELSE id END"), "a record's key"),
        (("--args-expr", "id"), "--args-expr must return an array"),
        (("--priority", "99999"), "priority for search.index_annotation must be an integer"),
    ],
    ids=["unknown-column", "null-key", "args-not-array", "priority-range"],
)
def test_bad_input_is_a_one_line_usage_error(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    case: tuple[tuple[str, ...], str],
) -> None:
    extra, message = case
    path = _parquet(spark, tmp_path, 10)
    code, _, err = helpers.run(
        capsys, "backfill", "--database-url", db_url, "--source", f"parquet:{path}",
        "--task", TASK, "--tag", "backfill.bad", "--partitions", "2", *extra,
    )
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert message in err
    assert helpers.staged(db_url) == []


def test_partition_whose_feeding_executor_died_is_rolled_back(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An input cut short by a dead executor JVM looks complete: the writer sees its
    parent chain change (reparented children) and does not commit."""
    ledger.prepare(db_url, "fed", ledger.Partitioning(1, "id", "bigint"))
    config = writer.WriterConfig(db_url, "fed", 1, run_token=str(uuid.uuid4()))
    lines = [
        f"{mapping.task_id_for('fed', str(k))},\"{TASK}\",\"[]\",\"{{}}\",\"celery\",-10,"
        f"\"backfill.fed\",,,\n" for k in range(3)
    ]
    chain = iter([(100, 50), (100, 1)])  # at the start; before the commit: reparented
    monkeypatch.setattr(task, "feeder", lambda: next(chain))
    with pytest.raises(writer.ExecutorLost, match="partition 0: the executor feeding it died"):
        writer._write_partition(config, 0, [(3, "".join(lines).encode())])
    assert helpers.staged(db_url) == []
    assert helpers.ledger(db_url, "fed") == {}
    monkeypatch.setattr(task, "feeder", lambda: (100, 50))
    assert writer._write_partition(config, 0, [(3, "".join(lines).encode())]).rows == 3
    assert len(helpers.staged(db_url)) == 3
