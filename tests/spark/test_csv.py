"""CSV sources: malformed rows are rejects, never jobs with NULLs or changed types.

* A short row (too few fields) is a reject, not a job with ``"n": null``.
* One bad value (``x20``) among numbers is a reject; the column stays numeric
  for every other job (Spark alone would make it a string for all of them).
* ``--schema`` types the columns as given: the same value is a plain string
  under ``n string``, a reject under ``n int``.
* Without ``--rejects`` the first malformed row ends the run, nothing staged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.spark import helpers

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

TASK = "search.index"


def _csv(tmp_path: Path, bad: str) -> str:
    """ids 1..20 with n = 10 * id, text 'tID'; row 7 replaced by ``bad``."""
    lines = ["id,n,text"] + [bad if i == 7 else f"{i},{i * 10},t{i}" for i in range(1, 21)]
    path = tmp_path / "records.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _backfill(db_url: str, path: str, *extra: str) -> tuple[str, ...]:
    return ("backfill", "--database-url", db_url, "--source", f"csv:{path}", "--task", TASK,
            "--kwargs-expr", "struct(*)", "--tag", "backfill.csv", "--partitions", "2", *extra)


@pytest.mark.parametrize(
    "case",
    [("7", "malformed CSV row: too few or too many fields"),
     ("7,x20,t7", 'malformed CSV row: {"n":"x20"} is not a int')],
    ids=["short-row", "bad-value"],
)
def test_a_malformed_row_is_a_reject_and_the_others_keep_their_types(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    case: tuple[str, str],
) -> None:
    """Before: the short row was staged as {"id": 7, "n": null, "text": null}; with x20
    every one of the 20 jobs had n as a string ("10", "x20", ...)."""
    bad, reason = case
    path = _csv(tmp_path, bad)
    code, _, err = helpers.run(capsys, *_backfill(db_url, path))
    assert code != 0
    assert "record 7 (partition" in err and reason in err and "nothing was staged" in err
    assert helpers.staged(db_url) == []

    rejects = tmp_path / "rejects.jsonl"
    result = helpers.run_json(capsys, *_backfill(db_url, path, "--rejects", str(rejects)))
    assert result["rows"] == 19
    found = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [(r["key"], r["reason"]) for r in found] == [("7", reason)]
    kwargs = sorted((r["kwargs"] for r in helpers.staged(db_url)), key=lambda k: k["id"])
    assert kwargs == [{"id": i, "n": i * 10, "text": f"t{i}"} for i in range(1, 21) if i != 7]


def test_schema_types_the_columns_as_given(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _csv(tmp_path, "7,x20,t7")
    result = helpers.run_json(capsys, *_backfill(
        db_url, path, "--schema", "id long, n string, text string", "--id", "as-text"))
    assert result["rows"] == 20
    texts = {r["kwargs"]["id"]: r["kwargs"]["n"] for r in helpers.staged(db_url)}
    assert (texts[7], texts[8]) == ("x20", "80")

    rejects = tmp_path / "rejects.jsonl"
    result = helpers.run_json(capsys, *_backfill(
        db_url, path, "--schema", "id long, n int, text string", "--id", "as-int",
        "--rejects", str(rejects), "--tag", "backfill.int"))
    assert result["rows"] == 19
    assert [json.loads(line)["key"] for line in rejects.read_text().splitlines()] == ["7"]

    code, _, err = helpers.run(capsys, *_backfill(db_url, path, "--schema", "id long, n"))
    assert code == 2 and err.startswith("drain: error: bad --schema 'id long, n'")
    code, _, err = helpers.run(capsys, *_backfill(db_url, path, "--schema", "id long"))
    assert code == 2 and "--schema gives 1 column(s), the CSV header 3 (id, n, text)" in err


def test_dry_run_makes_the_split_the_run_makes(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: --dry-run said it would stage 20 jobs, counting the malformed row 7 as
    one; the run staged 19 and refused 1 (or, without --rejects, refused the run)."""
    path = _csv(tmp_path, "7,x20,t7")
    rejects = tmp_path / "rejects.jsonl"
    reason = 'malformed CSV row: {"n":"x20"} is not a int'
    dry = helpers.run_json(capsys, *_backfill(db_url, path, "--rejects", str(rejects),
                                              "--dry-run"))
    assert (dry["count"], dry["rejected"], dry["rejects_file"]) == (19, 1, str(rejects))
    [refused] = dry["rejected_sample"]
    assert (refused["key"], refused["reason"]) == ("7", reason)
    assert not rejects.exists()  # a dry run writes nothing
    code, out, _ = helpers.run(capsys, *_backfill(db_url, path, "--rejects", str(rejects),
                                                  "--dry-run", "--sample", "2"))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("dry run: backfill 'backfill.csv' would stage 19 job(s) in 2 "
                        "partitions; the first 2 by key:")
    assert lines[3] == (f"and would refuse 1 record(s) (a run lists them in {rejects}); the "
                        "first 1 by key:")
    assert json.loads(lines[4]) == refused
    # Without --rejects the run stops at the malformed row: so does the dry run.
    code, _, err = helpers.run(capsys, *_backfill(db_url, path, "--dry-run"))
    assert code == 2
    assert err.startswith("drain: error: record 7 (partition ") and reason in err
    # ... and the run makes the split the dry run showed.
    result = helpers.run_json(capsys, *_backfill(db_url, path, "--rejects", str(rejects)))
    assert (result["rows"], result["rejected"]) == (19, 1)
    assert len(helpers.staged(db_url)) == 19
