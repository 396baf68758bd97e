"""``--json-file PATH``: the result in a file of its own.

* Under a real ``spark-submit`` (local master, drain in ``--py-files`` as
  docs/spark.md shows), Spark's Python runner merges the driver's stderr into
  its stdout: drain's error line lands on spark-submit's stdout, with
  ``--json``'s object. ``--json-file`` holds the result alone, and a failed
  run leaves it as it was.
* The same from the ``drain`` command: the file is written atomically (no
  temporary file left), only on success; a PATH that cannot be written is
  refused before any work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from drain.spark import bundle, session
from tests.spark import helpers

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

TASK = "search.index_annotation"


def _argv(db_url: str, path: str, run_id: str, *extra: str) -> list[str]:
    return ["backfill", "--database-url", db_url, "--source", f"parquet:{path}", "--task", TASK,
            "--kwargs", "annotation_id=id", "--tag", "backfill.json", "--id", run_id,
            "--partitions", "2", *extra]


def _spark_submit(tmp_path: Path, args: list[str], name: str) -> tuple[int, str, str]:
    """``spark-submit --master local[1] ... drain_submit.py ARGS``: exit code, stdout and
    stderr, each read from its own file (as ``> out 2> err`` would keep them)."""
    import pyspark

    archive, script = bundle.write(tmp_path / "bundle")
    argv = [str(Path(pyspark.__file__).parent / "bin" / "spark-submit"), "--master", "local[1]",
            "--conf", "spark.ui.enabled=false", "--conf", f"spark.pyspark.python={sys.executable}",
            "--py-files", str(archive)]
    jar = session.jdbc_jar()
    if jar is not None:
        argv += ["--jars", str(jar)]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DRAIN_")},
           "PYSPARK_PYTHON": sys.executable}
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        code = subprocess.run([*argv, str(script), *args], stdout=stdout, stderr=stderr,
                              stdin=subprocess.DEVNULL, cwd=tmp_path, check=False,
                              env=env, timeout=600).returncode
    return code, out.read_text(errors="replace"), err.read_text(errors="replace")


@pytest.mark.slow  # spark-submit: a JVM of its own
def test_under_spark_submit_the_json_file_holds_the_result_apart_from_errors(
    spark: SparkSession, db_url: str, tmp_path: Path
) -> None:
    """Before: ``--json > out.json 2> err.log`` put the one-line error in out.json (and
    err.log held only Spark's log), and there was no other place for the JSON."""
    path = str(tmp_path / "records.parquet")
    spark.range(0, 25).write.parquet(path)
    result = tmp_path / "result.json"
    code, out, err = _spark_submit(
        tmp_path, _argv(db_url, path, "submitted", "--json", "--json-file", str(result)), "ok")
    assert code == 0, out[-3000:] + err[-3000:]
    written = json.loads(result.read_text())
    assert (written["rows"], written["run_id"], written["written"]) == (25, "submitted", 2)
    assert len(helpers.staged(db_url, "backfill.json")) == 25

    code, out, err = _spark_submit(tmp_path, _argv(
        db_url, path, "refused", "--where", "nope = 1", "--json", "--json-file", str(result)),
        "bad")
    assert code == 2  # spark-submit exits with the driver's code
    # The merge: drain's error is on spark-submit's stdout, not on its stderr ...
    assert "drain: error: Spark: [UNRESOLVED_COLUMN" in out
    assert "drain: error" not in err
    # ... and the JSON file still holds the last successful run's result, alone.
    assert json.loads(result.read_text()) == written


def test_json_file_is_written_whole_and_only_on_success(
    spark: SparkSession, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "records.parquet")
    spark.range(0, 30).write.parquet(path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = out_dir / "result.json"
    code, out, err = helpers.run(capsys, *_argv(db_url, path, "cli", "--json-file", str(result)))
    assert code == 0, err
    assert out.startswith("backfill 'cli': staged 30 job(s) in 2 partitions")  # text on stdout
    written = json.loads(result.read_text())
    assert (written["rows"], written["already_complete"]) == (30, False)
    assert [p.name for p in out_dir.iterdir()] == ["result.json"]  # no temporary file left

    dry = out_dir / "dry.json"
    code, out, err = helpers.run(capsys, *_argv(db_url, path, "cli-dry", "--dry-run",
                                                "--json-file", str(dry)))
    assert code == 0, err
    assert out.startswith("dry run: backfill 'cli-dry' would stage 30 job(s)")
    assert (json.loads(dry.read_text())["dry_run"], json.loads(dry.read_text())["count"]) == (
        True, 30)

    code, _, err = helpers.run(capsys, *_argv(db_url, path, "cli-bad", "--where", "nope = 1",
                                              "--json-file", str(result)))
    assert code == 2
    assert json.loads(result.read_text()) == written  # a failed run leaves it as it was

    missing = tmp_path / "missing" / "result.json"
    code, _, err = helpers.run(capsys, *_argv(db_url, path, "cli-nowhere",
                                              "--json-file", str(missing)))
    assert code == 2
    assert err == (f"drain: error: --json-file {missing}: no such directory "
                   f"'{missing.parent}'\n")
    assert helpers.ledger(db_url, "cli-nowhere") == {}
