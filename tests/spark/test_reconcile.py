"""``drain reconcile``: missing, stale and extra records, and their repair end to end.

* Against tables (over JDBC) and against files exported from the downstream,
  the report counts and names exactly the missing, stale and extra ids.
* --stage stages one repair job per missing or stale record (none for extra
  ones), with its own tag, through the idempotent writer.
* End to end, with a real ``drain run`` and Celery worker: celery_app's
  search index is built by a reconcile of an empty index, broken (rows
  deleted, annotations edited after indexing, a stray row), reported, and
  repaired by ``reconcile --stage``; a last reconcile finds nothing to repair.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from drain.spark import mapping
from tests import support
from tests.spark import helpers

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

TASK = "search.index_annotation"
_SEARCH_INDEX = """
CREATE TABLE IF NOT EXISTS search_index (
    annotation_id bigint PRIMARY KEY,
    indexed_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    times_indexed integer NOT NULL DEFAULT 1
)
"""


def _annotations(db_url: str, n: int) -> None:
    helpers.execute(
        db_url,
        "CREATE TABLE annotation (id bigint PRIMARY KEY, "
        "updated_at timestamptz NOT NULL DEFAULT clock_timestamp())",
        f"INSERT INTO annotation (id) SELECT generate_series(1, {n})",
        _SEARCH_INDEX,
    )


def _break(db_url: str) -> None:
    """Missing 3, 10, 20; stale 4, 11 (edited after indexing); extra 9001."""
    helpers.execute(
        db_url,
        "DELETE FROM search_index WHERE annotation_id IN (3, 10, 20)",
        "UPDATE annotation SET updated_at = clock_timestamp() WHERE id IN (4, 11)",
        "INSERT INTO search_index (annotation_id) VALUES (9001)",
    )


def _reconcile_argv(db_url: str, *extra: str) -> tuple[str, ...]:
    return (
        "reconcile", "--database-url", db_url, "--source", "table:annotation",
        "--version-column", "updated_at", "--downstream", "table:search_index",
        "--downstream-id-column", "annotation_id", "--downstream-version-column", "indexed_at",
        "--partitions", "3", *extra,
    )


def _counts(report: dict[str, Any]) -> dict[str, int]:
    return {k: report[k]["count"] for k in ("missing", "stale", "extra")}


def test_report_names_missing_stale_and_extra_ids(
    spark: SparkSession, jdbc: None, db_url: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _annotations(db_url, 30)
    helpers.execute(db_url, "INSERT INTO search_index (annotation_id) SELECT id FROM annotation")
    _break(db_url)
    report_file = tmp_path / "report.json"
    report = helpers.run_json(capsys, *_reconcile_argv(db_url, "--report", str(report_file)))
    assert _counts(report) == {"missing": 3, "stale": 2, "extra": 1}
    assert report["missing"]["sample"] == [3, 10, 20]
    assert report["stale"]["sample"] == [4, 11]
    assert report["extra"]["sample"] == [9001]
    assert (report["source_records"], report["downstream_records"], report["ok"]) == (30, 28, 25)
    assert json.loads(report_file.read_text()) == report
    assert helpers.staged(db_url) == []  # a report only

    # Both sides read in parallel, split on their ids: the same report.
    split = helpers.run_json(capsys, *_reconcile_argv(
        db_url, "--partition-column", "id", "--downstream-partition-column", "annotation_id",
        "--read-partitions", "3"))
    assert _counts(split) == _counts(report)
    assert [split[k]["sample"] for k in ("missing", "stale", "extra")] == [
        report[k]["sample"] for k in ("missing", "stale", "extra")]

    code, out, _ = helpers.run(capsys, *_reconcile_argv(db_url, "--sample", "2"))
    assert code == 0
    assert out.splitlines() == [
        "reconcile: 30 source record(s), 28 downstream record(s)",
        "  missing             3   e.g. 3, 10, ...",
        "  stale               2   e.g. 4, 11",
        "  extra               1   e.g. 9001",
        "  up to date         25",
    ]


def test_stage_queues_one_repair_per_missing_or_stale_record(
    spark: SparkSession, jdbc: None, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _annotations(db_url, 30)
    helpers.execute(db_url, "INSERT INTO search_index (annotation_id) SELECT id FROM annotation")
    _break(db_url)
    report = helpers.run_json(capsys, *_reconcile_argv(
        db_url, "--stage", "--task", TASK, "--kwargs", "annotation_id=id",
        "--tag", "reconcile.search", "--id", "repair-1", "--priority", "-5",
    ))
    assert report["staged"]["rows"] == 5
    assert (report["staged"]["tag"], report["staged"]["run_id"]) == ("reconcile.search", "repair-1")
    rows = helpers.staged(db_url)
    assert sorted(r["kwargs"]["annotation_id"] for r in rows) == [3, 4, 10, 11, 20]
    assert {(r["task_name"], r["tag"], r["priority"]) for r in rows} == {
        (TASK, "reconcile.search", -5)
    }
    assert {r["task_id"] for r in rows} == {
        str(mapping.task_id_for("repair-1", str(i))) for i in (3, 4, 10, 11, 20)
    }
    # The same run id again: its partitions are committed, nothing new is staged.
    again = helpers.run_json(capsys, *_reconcile_argv(
        db_url, "--stage", "--task", TASK, "--kwargs", "annotation_id=id",
        "--tag", "reconcile.search", "--id", "repair-1",
    ))
    assert again["staged"]["already_complete"] is True
    assert len(helpers.staged(db_url)) == 5


def test_downstream_exported_as_files(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truth = tmp_path / "truth.parquet"
    spark.range(1, 101).selectExpr("id", "id % 5 AS revision").write.parquet(str(truth))
    export = tmp_path / "export.csv"
    # The downstream export: CSV text, ids and revisions as strings; 7 missing, 2 behind, one
    # ahead (different, not older), one unknown id.
    lines = ["doc_id,rev"]
    for i in range(1, 101):
        if i in (5, 6, 7, 50, 51, 52, 53):
            continue
        rev = i % 5
        rev = {8: rev - 1, 9: rev - 1, 12: rev + 1}.get(i, rev)
        lines.append(f"{i},{rev}")
    lines.append("777,1")
    export.write_text("\n".join(lines) + "\n")
    ids = ("reconcile", "--database-url", db_url, "--source", f"parquet:{truth}",
           "--downstream", f"csv:{export}", "--downstream-id-column", "doc_id")
    argv = (*ids, "--version-column", "revision", "--downstream-version-column", "rev")
    older = helpers.run_json(capsys, *argv)
    assert _counts(older) == {"missing": 7, "stale": 2, "extra": 1}
    assert older["stale"]["sample"] == [8, 9]
    different = helpers.run_json(capsys, *argv, "--stale-when", "different")
    assert different["stale"]["sample"] == [8, 9, 12]
    no_versions = helpers.run_json(capsys, *ids)
    assert _counts(no_versions) == {"missing": 7, "stale": 0, "extra": 1}


def _files(spark: SparkSession, tmp_path: Path, truth: list[tuple[Any, ...]],
           downstream: list[tuple[Any, ...]]) -> tuple[str, ...]:
    """Both sides as Parquet files (id, version); the reconcile argv comparing them."""
    paths = []
    for name, rows in (("truth", truth), ("downstream", downstream)):
        path = str(tmp_path / f"{name}.parquet")
        spark.createDataFrame(rows, "id long, version long").write.parquet(path)
        paths.append(path)
    return ("--source", f"parquet:{paths[0]}", "--downstream", f"parquet:{paths[1]}",
            "--version-column", "version", "--partitions", "2")


@pytest.mark.parametrize("side", ["source", "downstream"])
def test_null_ids_are_counted_apart_and_never_staged(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    side: str,
) -> None:
    """Before: a NULL downstream id was a missing source record (missing.sample [null, 2],
    source_records 8 for 7 rows) and --stage failed on its NULL key, staging nothing."""
    truth: list[tuple[int | None, int]] = [(i, 1) for i in range(1, 8)]
    downstream: list[tuple[int | None, int]] = [(i, 1) for i in range(1, 8) if i != 2]
    (truth if side == "source" else downstream).append((None, 1))
    argv = ("reconcile", "--database-url", db_url,
            *_files(spark, tmp_path, truth, downstream))
    report = helpers.run_json(capsys, *argv)
    assert _counts(report) == {"missing": 1, "stale": 0, "extra": 0}
    assert report["missing"]["sample"] == [2]
    assert (report["source_records"], report["downstream_records"], report["ok"]) == (
        len(truth), len(downstream), 6)
    assert report["null_ids"] == {"source": int(side == "source"),
                                  "downstream": int(side == "downstream")}
    code, out, _ = helpers.run(capsys, *argv)
    assert code == 0
    assert (f"  NULL id: {int(side == 'source')} source row(s), "
            f"{int(side == 'downstream')} downstream row(s)") in out

    staged = helpers.run_json(capsys, *argv, "--stage", "--task", TASK, "--kwargs",
                              "annotation_id=id", "--tag", "reconcile.nulls", "--id", "r1")
    assert staged["staged"]["rows"] == 1
    assert [r["kwargs"] for r in helpers.staged(db_url)] == [{"annotation_id": 2}]


def test_duplicated_ids_are_counted_once_on_each_side(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Source id 3 on two rows (versions 1, 2), downstream id 4 on three rows: each id
    counts once, 3 as its newest version (stale), and the rows are reported. Before:
    id 3 was compared twice (ok and stale) and no duplicate was reported: ok 5,
    downstream_records 7 for 8 rows."""
    truth = [(i, 1) for i in range(1, 7)] + [(3, 2)]
    downstream = [(i, 1) for i in range(1, 6)] + [(4, 1), (4, 1), (9, 1)]
    argv = ("reconcile", "--database-url", db_url,
            *_files(spark, tmp_path, truth, downstream))
    report = helpers.run_json(capsys, *argv)
    assert _counts(report) == {"missing": 1, "stale": 1, "extra": 1}
    assert (report["missing"]["sample"], report["stale"]["sample"]) == ([6], [3])
    assert (report["source_records"], report["downstream_records"], report["ok"]) == (7, 8, 4)
    assert report["duplicate_ids"] == {
        "source": {"count": 1, "rows": 2, "sample": [3]},
        "downstream": {"count": 1, "rows": 3, "sample": [4]},
    }
    assert report["null_ids"] == {"source": 0, "downstream": 0}
    code, out, _ = helpers.run(capsys, *argv)
    assert code == 0
    assert "  duplicated: 1 source id(s) on 2 rows" in out
    assert "  duplicated: 1 downstream id(s) on 3 rows" in out

    staged = helpers.run_json(capsys, *argv, "--stage", "--task", TASK, "--kwargs",
                              "id,version", "--tag", "reconcile.dups", "--id", "r1")
    assert staged["staged"]["rows"] == 2
    assert sorted((r["kwargs"]["id"], r["kwargs"]["version"]) for r in helpers.staged(db_url)
                  ) == [(3, 2), (6, 1)]


def test_stage_without_task_is_a_usage_error(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = helpers.run(
        capsys, "reconcile", "--database-url", db_url, "--source", f"parquet:{tmp_path}",
        "--downstream", f"parquet:{tmp_path}", "--stage", "--tag", "reconcile.x",
    )
    assert code == 2
    assert err == "drain: error: --stage needs --task and --tag (e.g. reconcile.search_index)\n"


def _index(db_url: str) -> dict[int, tuple[int, bool]]:
    """search_index as {annotation_id: (times_indexed, fresh)}; fresh: indexed after the
    annotation's last update."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT s.annotation_id, s.times_indexed, s.indexed_at >= a.updated_at "
            "FROM search_index s LEFT JOIN annotation a ON a.id = s.annotation_id"
        ).fetchall()
    return {int(i): (int(n), bool(fresh)) for i, n, fresh in rows}


@pytest.mark.usefixtures("jdbc")
@pytest.mark.broker  # a drain and a worker
def test_reconcile_stage_repairs_the_search_index_end_to_end(
    db_url: str, queue: str, spawn: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _annotations(db_url, 40)
    env = support.drain_env(db_url)
    worker = spawn(support.celery_argv(queue), env, "worker")
    runner = spawn(support.drain_argv("run", "--poll-interval", "0.5"), env, "drain")
    worker.wait_for_output("ready.", timeout=60)
    runner.wait_for_output("broker connected", timeout=30)
    stage = ("--stage", "--task", TASK, "--kwargs", "annotation_id=id", "--queue", queue,
             "--tag", "reconcile.search")

    # An empty index: everything is missing; the repair builds it.
    first = helpers.run_json(capsys, *_reconcile_argv(db_url, *stage))
    assert _counts(first) == {"missing": 40, "stale": 0, "extra": 0}
    assert first["staged"]["rows"] == 40
    support.wait_for(lambda: len(_index(db_url)) == 40, 90, "the worker to index 40 annotations")

    _break(db_url)
    second = helpers.run_json(capsys, *_reconcile_argv(db_url, *stage))
    assert _counts(second) == {"missing": 3, "stale": 2, "extra": 1}
    assert second["staged"]["rows"] == 5
    support.wait_for(
        lambda: (index := _index(db_url)) and all(
            index.get(i, (0, False))[1] for i in range(1, 41)
        ),
        90, "the worker to repair the missing and stale entries",
    )
    index = _index(db_url)
    assert {i for i, (n, _) in index.items() if n == 2} == {4, 11}  # stale: indexed again
    assert {i for i, (n, _) in index.items() if n == 1} == set(range(1, 41)) - {4, 11} | {9001}
    ran = support.executed(db_url)
    assert len(ran) == 45  # 40 + 5 repairs, each run once
    with psycopg.connect(db_url) as conn:
        tags = conn.execute("SELECT DISTINCT tag FROM executed_jobs").fetchall()
    assert tags == [("reconcile.search",)]

    third = helpers.run_json(capsys, *_reconcile_argv(db_url, *stage))
    assert _counts(third) == {"missing": 0, "stale": 0, "extra": 1}
    assert third["staged"]["rows"] == 0
    assert support.staged_count(db_url) == 0


def test_downstream_ids_the_source_type_cannot_hold_are_counted_apart(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A text downstream id that is not a number ("x7") costs that row: counted apart and
    sampled, compared with nothing; source id 7 is then missing, and repaired. Before: the
    whole reconcile failed with exit 1, "[CAST_INVALID_INPUT] ... Use `try_cast`"."""
    truth = str(tmp_path / "truth.parquet")
    spark.createDataFrame([(i, 1) for i in range(1, 9)], "id long, version long").write.parquet(
        truth)
    downstream = str(tmp_path / "downstream.parquet")
    spark.createDataFrame(
        [(str(i), 1) for i in (1, 2, 3, 4, 5, 6, 8)] + [("x7", 1), (None, 1)],
        "doc string, version long").write.parquet(downstream)
    argv = ("reconcile", "--database-url", db_url, "--source", f"parquet:{truth}",
            "--downstream", f"parquet:{downstream}", "--downstream-id-column", "doc",
            "--version-column", "version", "--partitions", "2")
    report = helpers.run_json(capsys, *argv)
    assert _counts(report) == {"missing": 1, "stale": 0, "extra": 0}
    assert report["missing"]["sample"] == [7]
    assert report["unreadable_ids"] == {"count": 1, "type": "bigint", "sample": ["x7"]}
    assert report["null_ids"] == {"source": 0, "downstream": 1}
    assert (report["source_records"], report["downstream_records"], report["ok"]) == (8, 9, 7)
    code, out, _ = helpers.run(capsys, *argv)
    assert code == 0
    assert ("  unreadable: 1 downstream id(s) not a bigint like the source's (compared with "
            "nothing)   e.g. x7") in out.splitlines()
    staged = helpers.run_json(capsys, *argv, "--stage", "--task", TASK, "--kwargs",
                              "annotation_id=id", "--tag", "reconcile.unreadable", "--id", "r1")
    assert staged["staged"]["rows"] == 1
    assert [r["kwargs"] for r in helpers.staged(db_url)] == [{"annotation_id": 7}]


def test_a_downstream_version_the_source_type_cannot_hold_is_one_line(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Versions are compared as the source's type: one that cannot be read is a usage error
    (exit 2) that says which value and what to do, not Spark's advice to use try_cast.
    Before: exit 1, "Spark failed: [CAST_INVALID_INPUT] ... Use `try_cast` ..."."""
    truth = str(tmp_path / "truth.parquet")
    spark.createDataFrame([(i, 1) for i in range(1, 5)], "id long, version long").write.parquet(
        truth)
    downstream = str(tmp_path / "downstream.parquet")
    spark.createDataFrame([(1, "1"), (2, "v2"), (3, "1")], "id long, version string"
                          ).write.parquet(downstream)
    code, _, err = helpers.run(
        capsys, "reconcile", "--database-url", db_url, "--source", f"parquet:{truth}",
        "--downstream", f"parquet:{downstream}", "--version-column", "version")
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert err.startswith("drain: error: Spark cannot read the value 'v2' (string) as bigint: "
                          "correct it in the data, or convert the column yourself"), err
    assert "Use `try_cast`" not in err, err
