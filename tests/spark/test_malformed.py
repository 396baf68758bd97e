"""Malformed records of a file source are rejects, named as such, as a CSV's are.

* A Parquet string that is not valid UTF-8 (a top-level column, an array's
  element) is never staged with U+FFFD in place of its bytes: by default the run
  stops, staging nothing, in one line naming the record and the column; with
  ``--rejects`` it is listed and the others are staged.
* A JSON line that does not parse is reported as a malformed line of its file,
  with its text, not as a record whose key is NULL; by a dry run too.
"""

from __future__ import annotations

import array
import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.spark import helpers

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

TASK = "search.index_annotation"


def _strings(values: list[bytes]) -> object:
    """A pyarrow string array holding these bytes as they are (pyarrow would check them)."""
    import pyarrow as pa

    offsets = array.array("i", [0])
    for value in values:
        offsets.append(offsets[-1] + len(value))
    return pa.Array.from_buffers(pa.string(), len(values), [
        None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(values))])


def _invalid_utf8(tmp_path: Path) -> str:
    """ids 0..9; record 3's text and one of record 6's tags are Latin-1, not UTF-8."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [b"caf\xe9" if i == 3 else f"body {i}".encode() for i in range(10)]
    tags = [[b"ok", b"\xff\xfe" if i == 6 else b"fine"] for i in range(10)]
    flat = _strings([t for pair in tags for t in pair])
    path = str(tmp_path / "records.parquet")
    pq.write_table(pa.table({
        "id": pa.array(range(10), pa.int64()),
        "text": _strings(texts),
        "tags": pa.ListArray.from_arrays(pa.array(range(0, 21, 2), pa.int32()), flat),
    }), path)
    return path


def _argv(db_url: str, source: str, *extra: str) -> tuple[str, ...]:
    return ("backfill", "--database-url", db_url, "--source", source, "--task", TASK,
            "--kwargs", "annotation_id=id,text", "--tag", "backfill.malformed",
            "--partitions", "2", *extra)


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The command's one line on stderr; it must exit 2."""
    code, _, err = helpers.run(capsys, *argv)
    assert code == 2, err
    assert err.count("\n") == 1, err
    return err


def test_invalid_utf8_in_a_parquet_string_is_a_reject(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: exit 0, all 10 staged, record 3's text "caf\ufffd"."""
    path = _invalid_utf8(tmp_path)
    err = _refused(capsys, *_argv(db_url, f"parquet:{path}"))
    assert err.startswith("drain: error: record 3 (partition "), err
    assert ("): malformed Parquet record: invalid UTF-8 in column text; nothing was staged "
            "(--rejects FILE") in err
    assert helpers.staged(db_url) == []

    rejects = tmp_path / "rejects.jsonl"
    summary = helpers.run_json(capsys, *_argv(db_url, f"parquet:{path}", "--rejects",
                                              str(rejects)))
    assert (summary["rows"], summary["rejected"]) == (8, 2)
    listed = sorted((json.loads(line) for line in rejects.read_text().splitlines()),
                    key=lambda r: r["key"])
    assert [(r["key"], r["reason"]) for r in listed] == [
        ("3", "malformed Parquet record: invalid UTF-8 in column text"),
        ("6", "malformed Parquet record: invalid UTF-8 in column tags"),
    ]
    kwargs = sorted((r["kwargs"] for r in helpers.staged(db_url)),
                    key=lambda k: k["annotation_id"])
    assert [k["annotation_id"] for k in kwargs] == [0, 1, 2, 4, 5, 7, 8, 9]
    assert all("\ufffd" not in k["text"] for k in kwargs)


def _json_lines(tmp_path: Path) -> Path:
    """ids 1..9 as JSON lines; line 5 does not parse."""
    path = tmp_path / "records.json"
    lines = [json.dumps({"id": i, "text": f"body {i}"}) for i in range(1, 10)]
    lines[4] = '{"id": 5, "text": "unterminated}'
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_malformed_json_line_is_named_as_such(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: exit 2, "a record's key (id) is NULL; nothing was staged"."""
    path = _json_lines(tmp_path)
    err = _refused(capsys, *_argv(db_url, f"json:{path}"))
    assert err.startswith(f"drain: error: malformed JSON line in file:{path}: "
                          '{"id": 5, "text": "unterminated}; nothing was staged (--rejects'), err
    assert helpers.staged(db_url) == []

    rejects = tmp_path / "rejects.jsonl"
    summary = helpers.run_json(capsys, *_argv(db_url, f"json:{path}", "--rejects",
                                              str(rejects)))
    assert (summary["rows"], summary["rejected"]) == (8, 1)
    assert [json.loads(line) for line in rejects.read_text().splitlines()] == [{
        "key": None, "partition": None,
        "reason": f'malformed JSON line in file:{path}: {{"id": 5, "text": "unterminated}}',
    }]
    assert sorted(r["kwargs"]["annotation_id"] for r in helpers.staged(db_url)) == [
        1, 2, 3, 4, 6, 7, 8, 9]


def test_a_dry_run_names_a_malformed_json_line_as_the_run_does(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: exit 2, "a record's key (id) is NULL; nothing was staged"."""
    path = _json_lines(tmp_path)
    argv = _argv(db_url, f"json:{path}", "--dry-run", "--sample", "1")
    err = _refused(capsys, *argv)
    assert err.startswith(f"drain: error: malformed JSON line in file:{path}: "), err
    rejects = str(tmp_path / "rejects.jsonl")
    plan = helpers.run_json(capsys, *argv, "--rejects", rejects)
    assert (plan["count"], plan["rejected"]) == (8, 1)
    assert plan["rejected_sample"][0]["key"] is None
    assert plan["rejected_sample"][0]["reason"].startswith("malformed JSON line in file:")
    assert helpers.staged(db_url) == []
