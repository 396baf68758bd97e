"""Records -> staged_jobs columns, computed in Spark SQL.

* Task ids are RFC 4122 uuid5s, identical to Python's uuid.uuid5 for the same
  backfill id and key (non-ASCII keys included).
* Args and kwargs are strict JSON whatever the values (quotes, backslashes,
  NULLs, non-ASCII), from columns or from expressions of the right type;
  ``struct(*)`` and ``array(*)`` are the source's columns only, and a Celery
  worker runs a task taking exactly them.
* A spread puts not_before inside the window, the same for a key every time.
* Each job's _bucket is the partition Spark's hash partitioning puts it in.
* Importing drain (its CLI included) does not import pyspark.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from drain.errors import ConfigError, StagingError
from drain.spark import mapping
from tests import support
from tests.spark import helpers

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

pytestmark = pytest.mark.spark

TRICKY = ['plain', 'quote " inside', "back\\slash", "ünïcødé ✓", "new\nline", "comma, here"]


def _frame(spark: SparkSession) -> DataFrame:
    rows = [(i, text, i % 2 == 0 or None) for i, text in enumerate(TRICKY)]
    return spark.createDataFrame(rows, "id long, text string, flag boolean")


def test_task_ids_are_python_uuid5s(spark: SparkSession) -> None:
    keys = ["1", "42", "ünï", 'q"uote', "x" * 300]
    df = spark.createDataFrame([(k,) for k in keys], "k string")
    m = mapping.Mapping(task_name="t", key="k", tag="backfill.t")
    got = {r["_key"]: r["task_id"] for r in mapping.jobs(df, m, "run-ü", 3).collect()}
    assert got == {k: str(mapping.task_id_for("run-ü", k)) for k in keys}
    assert {mapping.task_id_for("run-ü", k).version for k in keys} == {5}


def test_args_and_kwargs_are_exact_json(spark: SparkSession) -> None:
    df = _frame(spark)
    m = mapping.Mapping(
        task_name="t", key="id", tag="backfill.t",
        args=mapping.parse_columns("id,text,flag"),
        kwargs=mapping.parse_columns("annotation_id=id,text,flag"),
    )
    jobs = {r["_key"]: r for r in mapping.jobs(df, m, "r", 2).collect()}
    for i, text in enumerate(TRICKY):
        flag = True if i % 2 == 0 else None
        assert json.loads(jobs[i]["args"]) == [i, text, flag]
        assert json.loads(jobs[i]["kwargs"]) == {"annotation_id": i, "text": text, "flag": flag}


def test_expressions_for_args_and_kwargs(spark: SparkSession) -> None:
    df = _frame(spark)
    m = mapping.Mapping(
        task_name="t", key="id", tag="backfill.t", args_expr="array(id * 10, id + 1)",
        kwargs_expr="named_struct('annotation_id', id, 'upper', upper(text))",
    )
    jobs = {r["_key"]: r for r in mapping.jobs(df, m, "r", 2).collect()}
    assert json.loads(jobs[1]["args"]) == [10, 2]
    assert json.loads(jobs[1]["kwargs"]) == {"annotation_id": 1, "upper": 'QUOTE " INSIDE'}


def test_star_expressions_see_the_source_columns_only(spark: SparkSession) -> None:
    """struct(*) and array(*) are the record: no column of drain's (issue 26, item 3)."""
    df = spark.createDataFrame([(1, 10), (2, 20)], "id long, n long")
    m = mapping.Mapping(task_name="t", key="id", tag="backfill.t", args_expr="array(*)",
                        kwargs_expr="struct(*)")
    for partitions in (None, 2):
        jobs = {r["_key"]: r for r in mapping.jobs(df, m, "r", partitions).collect()}
        assert {k: json.loads(j["kwargs"]) for k, j in jobs.items()} == {
            1: {"id": 1, "n": 10}, 2: {"id": 2, "n": 20}}
        assert {k: json.loads(j["args"]) for k, j in jobs.items()} == {1: [1, 10], 2: [2, 20]}


def test_a_backfill_with_struct_star_stages_the_record_as_kwargs(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every staged job's kwargs fit a task taking exactly the source's columns
    (before: each job also had "_key", so index(id, text) failed on every job)."""
    path = str(tmp_path / "records.parquet")
    spark.range(0, 40).selectExpr("id", "concat('t', id) AS text").write.parquet(path)
    result = helpers.run_json(
        capsys, "backfill", "--database-url", db_url, "--source", f"parquet:{path}",
        "--task", "search.index", "--kwargs-expr", "struct(*)", "--args-expr", "array(id)",
        "--tag", "backfill.star", "--partitions", "3",
    )
    assert result["rows"] == 40

    def index(id: int, text: str) -> tuple[int, str]:
        return id, text

    rows = helpers.staged(db_url, "backfill.star")
    assert sorted(index(**r["kwargs"]) for r in rows) == [
        (i, f"t{i}") for i in range(40)]
    assert sorted(r["args"] for r in rows) == [[i] for i in range(40)]


@pytest.mark.broker  # a drain and a worker
def test_a_celery_worker_runs_every_job_of_a_struct_star_backfill(
    spark: SparkSession, db_url: str, queue: str, spawn: Any, *, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """celery_app's search.index_annotation(annotation_id) gets exactly its kwargs from
    struct(*) of a one-column source (before: each job also had _key: a TypeError)."""
    path = str(tmp_path / "annotations.parquet")
    spark.range(1, 11).selectExpr("id AS annotation_id").write.parquet(path)
    env = support.drain_env(db_url)
    worker = spawn(support.celery_argv(queue), env, "worker")
    runner = spawn(support.drain_argv("run", "--poll-interval", "0.5"), env, "drain")
    worker.wait_for_output("ready.", timeout=60)
    runner.wait_for_output("broker connected", timeout=30)
    result = helpers.run_json(
        capsys, "backfill", "--database-url", db_url, "--source", f"parquet:{path}",
        "--key", "annotation_id", "--task", "search.index_annotation",
        "--kwargs-expr", "struct(*)", "--queue", queue, "--tag", "backfill.star",
        "--partitions", "2",
    )
    assert result["rows"] == 10
    support.wait_for(lambda: len(support.executed(db_url)) == 10, 90,
                     "the worker to run 10 index_annotation jobs")
    assert sorted(r["kwargs"]["annotation_id"] for r in support.executed(db_url)) == list(
        range(1, 11))


def test_expressions_of_the_wrong_type_are_refused(spark: SparkSession) -> None:
    df = _frame(spark)
    with pytest.raises(ConfigError, match="--args-expr must return an array"):
        mapping.jobs(df, mapping.Mapping("t", "id", "b.t", args_expr="id"), "r", 2)
    with pytest.raises(ConfigError, match="--kwargs-expr must return a struct or a map"):
        mapping.jobs(df, mapping.Mapping("t", "id", "b.t", kwargs_expr="array(id)"), "r", 2)


def test_invalid_constants_are_refused_before_spark_runs() -> None:
    with pytest.raises(StagingError, match="priority"):
        mapping.Mapping("t", "id", "backfill.t", priority=40000).validate()
    with pytest.raises(StagingError, match="task name"):
        mapping.Mapping(" ", "id", "backfill.t").validate()
    with pytest.raises(ConfigError, match="tag is required"):
        mapping.Mapping("t", "id", "").validate()
    with pytest.raises(ConfigError, match="bad backfill id"):
        mapping.validate_run_id("a\x1fb")


def test_spread_is_inside_the_window_and_stable(spark: SparkSession) -> None:
    df = spark.range(0, 500)
    start = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
    m = mapping.Mapping("t", "id", "backfill.t", spread=dt.timedelta(hours=2),
                        spread_start=start)

    def moments() -> dict[int, dt.datetime]:
        return {
            r["_key"]: dt.datetime.fromisoformat(r["not_before"].replace("Z", "+00:00"))
            for r in mapping.jobs(df, m, "r", 4).collect()
        }

    first = moments()
    assert all(start <= t < start + dt.timedelta(hours=2) for t in first.values())
    # Spread out, not bunched: every quarter of the window gets a fair share.
    quarters = [int((t - start) / dt.timedelta(minutes=30)) for t in first.values()]
    assert all(quarters.count(q) > 80 for q in range(4))
    assert moments() == first


def test_bucket_is_the_partition_the_row_is_in(spark: SparkSession) -> None:
    df = spark.range(0, 300)
    jobs = mapping.jobs(df, mapping.Mapping("t", "id", "backfill.t"), "r", 7)
    seen = jobs.rdd.mapPartitionsWithIndex(
        lambda i, rows: [(i, sorted({r["_bucket"] for r in rows}))]
    ).collect()
    assert len(seen) == 7
    assert all(buckets in ([], [i]) for i, buckets in seen)


def test_core_drain_does_not_import_pyspark() -> None:
    code = (
        "import sys, drain, drain.cli.main, drain.spark, drain.cli.spark; "
        "drain.cli.main.build_parser(); drain.cli.spark.build_parser(); "
        "assert not [m for m in sys.modules if m.startswith(('pyspark', 'py4j'))], 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
