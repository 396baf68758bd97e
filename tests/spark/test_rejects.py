"""Failures that name their cause: records refused before any COPY, and Postgres' refusals.

* A record that can never become a job (a NUL in a text value, a NaN or an
  infinite float) ends the run before anything is staged, with one line in
  ``drain.stage``'s words that names its key and partition.
* With ``--rejects FILE`` the refused records are listed in FILE (partition,
  key, reason), counted in the summary, and every other record is staged.
* A row Postgres refuses during a partition's COPY fails the run with one
  line naming the partition and Postgres' message with the COPY line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from drain.spark import mapping
from tests.spark import helpers

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

TASK = "search.index_annotation"


def _records(spark: SparkSession, tmp_path: Path) -> str:
    """ids 0..99; record 17's body holds a NUL, record 42's score is NaN."""
    path = str(tmp_path / "records.parquet")
    spark.range(0, 100).selectExpr(
        "id",
        "CASE WHEN id = 17 THEN concat('a', char(0), 'b') ELSE concat('body ', id) END AS body",
        "CASE WHEN id = 42 THEN double('NaN') ELSE id / 2 END AS score",
    ).write.parquet(path)
    return path


def _argv(db_url: str, path: str, *extra: str) -> tuple[str, ...]:
    return ("backfill", "--database-url", db_url, "--source", f"parquet:{path}", "--task", TASK,
            "--tag", "backfill.rejects", "--partitions", "4", *extra)


def _partition(key: int) -> int:
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    assert spark is not None
    row = spark.sql(f"SELECT pmod(hash(CAST({key} AS string)), 4) AS p").collect()[0]
    return int(row["p"])


@pytest.mark.parametrize(
    "case",
    [
        (("--kwargs", "annotation_id=id,body"), 17,
         f"kwargs for {TASK} contain a NUL character, which jsonb refuses"),
        (("--args", "score"), 42,
         f"args for {TASK} are not JSON-serialisable: Out of range float values are not JSON "
         "compliant: nan; jsonb stores no NaN or infinity"),
    ],
    ids=["nul", "nan"],
)
def test_a_record_that_cannot_become_a_job_is_refused_before_any_copy(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    case: tuple[tuple[str, ...], int, str],
) -> None:
    extra, key, reason = case
    path = _records(spark, tmp_path)
    code, _, err = helpers.run(capsys, *_argv(db_url, path, *extra))
    assert code == 2, err
    assert err == (f"drain: error: record {key} (partition {_partition(key)}): {reason}; "
                   "nothing was staged (--rejects FILE stages the other records and lists "
                   "the refused ones in FILE)\n")
    assert helpers.staged(db_url) == []
    assert helpers.ledger(db_url, "backfill.rejects") == {}


def test_rejects_file_lists_the_refused_records_and_the_rest_is_staged(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _records(spark, tmp_path)
    rejects = tmp_path / "rejects.jsonl"
    result = helpers.run_json(capsys, *_argv(db_url, path, "--kwargs", "annotation_id=id,body",
                                             "--args", "score", "--rejects", str(rejects)))
    assert (result["rows"], result["rejected"]) == (98, 2)
    listed = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert sorted((r["key"], r["partition"]) for r in listed) == [
        ("17", _partition(17)), ("42", _partition(42))
    ]
    assert {r["key"]: r["reason"].split(" ")[0] for r in listed} == {"17": "kwargs", "42": "args"}
    staged = {r["kwargs"]["annotation_id"] for r in helpers.staged(db_url)}
    assert staged == set(range(100)) - {17, 42}
    assert {r["task_id"] for r in helpers.staged(db_url)} == {
        str(mapping.task_id_for("backfill.rejects", str(k))) for k in staged
    }
    code, out, _ = helpers.run(capsys, *_argv(db_url, path, "--kwargs", "annotation_id=id,body",
                                              "--args", "score", "--rejects", str(rejects),
                                              "--id", "again"))
    assert code == 0
    assert f"2 record(s) refused, listed in {rejects}" in out


def test_a_row_postgres_refuses_names_the_partition_and_the_copy_line(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    helpers.execute(
        db_url,
        "CREATE FUNCTION refuse_13() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF NEW.kwargs->>'annotation_id' = '13' THEN RAISE EXCEPTION 'annotation 13 is "
        "frozen'; END IF; RETURN NEW; END $$",
        "CREATE TRIGGER refuse_13 BEFORE INSERT ON staged_jobs FOR EACH ROW "
        "EXECUTE FUNCTION refuse_13()",
    )
    path = str(tmp_path / "ids.parquet")
    spark.range(0, 50).write.parquet(path)
    code, _, err = helpers.run(capsys, "backfill", "--database-url", db_url, "--source",
                               f"parquet:{path}", "--task", TASK, "--kwargs", "annotation_id=id",
                               "--tag", "backfill.refused", "--partitions", "4")
    assert code == 1, err
    assert err.count("\n") == 1, err
    assert err.startswith(f"drain: error: a Spark task failed: PartitionError: partition "
                          f"{_partition(13)}: Postgres refused it: annotation 13 is frozen "
                          "(PL/pgSQL function refuse_13() line 1 at RAISE)"), err
    assert "nothing of it was staged" in err
    assert helpers.ledger(db_url, "backfill.refused").get(_partition(13)) is None


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("named_struct('id', id, 'scores', array(1.5D, CASE WHEN id = 7 THEN double('NaN') "
         "ELSE 2.0D END))", "nan"),
        ("named_struct('id', id, 'by', map('a', CASE WHEN id = 7 THEN double('-Infinity') "
         "ELSE 0D END))", "-inf"),
    ],
    ids=["in-an-array", "a-map-value"],
)
def test_a_nested_nan_or_infinity_is_refused_before_any_copy(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    *, expression: str, value: str,
) -> None:
    path = str(tmp_path / "ids.parquet")
    spark.range(0, 20).write.parquet(path)
    code, _, err = helpers.run(capsys, *_argv(db_url, path, "--kwargs-expr", expression))
    assert code == 2, err
    assert err.startswith(
        f"drain: error: record 7 (partition {_partition(7)}): kwargs for {TASK} are not "
        f"JSON-serialisable: Out of range float values are not JSON compliant: {value}; "
    ), err
    assert helpers.staged(db_url) == []


def test_a_null_args_or_kwargs_expression_is_no_args_as_in_drain_stage(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "ids.parquet")
    spark.range(0, 4).write.parquet(path)
    result = helpers.run_json(capsys, *_argv(
        db_url, path, "--args-expr", "CASE WHEN id % 2 = 0 THEN array(id) END",
        "--kwargs-expr", "CASE WHEN id < 2 THEN named_struct('id', id) END",
    ))
    assert result["rows"] == 4
    jobs = sorted(json.dumps([r["args"], r["kwargs"]]) for r in helpers.staged(db_url))
    expected: list[list[object]] = [[[0], {"id": 0}], [[], {"id": 1}], [[2], {}], [[], {}]]
    assert jobs == sorted(json.dumps(j) for j in expected)


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (("--kwargs", "raw=blob"), "--kwargs value 'blob' holds binary data"),
        (("--kwargs-expr", "map(id, id)"), "--kwargs-expr value 'map(id, id)' is a map with "
         "bigint keys"),
        (("--args-expr", "array(named_struct('b', blob))"), "holds binary data"),
    ],
    ids=["binary", "map-keys", "nested-binary"],
)
def test_a_value_json_cannot_hold_is_refused_before_spark_runs(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    *, flags: tuple[str, ...], problem: str,
) -> None:
    path = str(tmp_path / "blobs.parquet")
    spark.range(0, 4).selectExpr("id", "binary(concat('x', id)) AS blob").write.parquet(path)
    code, _, err = helpers.run(capsys, *_argv(db_url, path, *flags))
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert problem in err, err
    assert "which a job's JSON cannot hold" in err
    assert helpers.staged(db_url) == []
