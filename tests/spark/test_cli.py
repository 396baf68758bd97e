"""The commands as processes and as part of ``drain``; the progress bar.

* ``python -m drain.spark backfill`` runs in its own process (its own local
  Spark) with drain's exit codes and one-line errors.
* ``backfill`` and ``reconcile`` plug into the ``drain`` parser
  (``spark_cli.add_parsers``) next to its own commands.
* While a job runs, the progress bar shows the stage's tasks; it ends with a
  newline.
* A failed job is reported only once its other tasks have ended.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from drain.cli import main as core
from drain.cli import spark as cli
from drain.spark import progress
from tests import support

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark


@pytest.mark.slow  # a JVM of its own
def test_module_runs_a_dry_run_in_its_own_process(
    spark: SparkSession, db_url: str, tmp_path: Path
) -> None:
    path = str(tmp_path / "records.parquet")
    spark.range(0, 25).write.parquet(path)
    env = {**support.drain_env(db_url), "DRAIN_SPARK_MASTER": "local[1]"}
    argv = [sys.executable, "-m", "drain.spark", "backfill", "--source", f"parquet:{path}",
            "--task", "search.index_annotation", "--kwargs", "annotation_id=id",
            "--tag", "backfill.proc", "--partitions", "2"]
    done = subprocess.run([*argv, "--dry-run"], env=env, capture_output=True, text=True,
                          timeout=180, check=False, cwd=support.ROOT)
    assert done.returncode == 0, done.stderr
    # As the runner role, which may not read the ledger: the dry run says so.
    assert done.stdout.startswith(
        "dry run: backfill 'backfill.proc' would stage 25 job(s) in 2 partitions (the ledger "
        "was not read: permission denied for table drain_backfills); the first 5 by "
        "key:\n"), done.stdout
    assert "Traceback" not in done.stderr
    bad = subprocess.run([*argv[:5], "parquet:/nonexistent/x", *argv[6:]], env=env,
                         capture_output=True, text=True, timeout=180, check=False,
                         cwd=support.ROOT)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.splitlines()[-1].startswith("drain: error: Spark: [PATH_NOT_FOUND]")
    assert support.staged_count(db_url) == 0


def test_commands_join_the_drain_parser() -> None:
    parser = core.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if "backfill" not in sub.choices:  # until drain/cli/main.py calls spark_cli.add_parsers
        cli.add_parsers(sub)
    args = parser.parse_args(["-v", "backfill", "--source", "table:annotation", "--task", "t",
                              "--tag", "backfill.t", "--partitions", "3"])
    assert (args.func, args.verbose, args.partitions) == (cli.cmd_backfill, True, 3)
    args = parser.parse_args(["reconcile", "--source", "table:a", "--downstream", "csv:/x"])
    assert args.func is cli.cmd_reconcile
    assert args.downstream.kind == "csv"
    with pytest.raises(SystemExit):
        parser.parse_args(["backfill", "--source", "excel:/x", "--task", "t", "--tag", "b"])


def test_progress_bar_shows_the_running_stage(spark: SparkSession, tmp_path: Path) -> None:
    assert progress.bar(3, 12, "tasks") == f"[{'#' * 7}{'.' * 23}]  3/12 tasks"
    flag = str(tmp_path / "go")
    out = io.StringIO()

    def wait_for_flag(_: object) -> list[int]:
        while not os.path.exists(flag):
            time.sleep(0.01)
        return [1]

    def release_when_drawn() -> None:
        support.wait_for(lambda: "/4 tasks" in out.getvalue(), 60, "the progress bar")
        Path(flag).touch()

    releaser = threading.Thread(target=release_when_drawn)
    releaser.start()
    try:
        with progress.tracking(spark.sparkContext, "test", enabled=True, stream=out,
                               interval=0.05):
            assert spark.sparkContext.parallelize(range(4), 4).mapPartitions(
                wait_for_flag
            ).count() == 4
    finally:
        Path(flag).touch()
        releaser.join()
    assert "\rtest: stage " in out.getvalue()
    assert out.getvalue().endswith("\n")


def test_a_failed_job_is_reported_once_its_other_tasks_ended(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Spark fails a job at its first lasting failure and kills its other tasks
    without waiting: a backfill partition inside its COPY could still commit after
    the error was reported (seen: a resume counted 102 staged rows, the failed run
    committed 43 more behind it). tracking() returns only once they ended."""
    started = tmp_path / "started"

    def task(index: int, _rows: object) -> list[int]:
        deadline = time.monotonic() + 60
        if index == 0:  # fails (every attempt) once the other task runs
            while not started.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError("fails on purpose")
        started.touch()
        while time.monotonic() < deadline:  # runs until Spark kills it
            time.sleep(0.01)
        return [index]

    sc = spark.sparkContext
    with (pytest.raises(Exception, match="fails on purpose"),
          progress.tracking(sc, "test", enabled=False) as group):
        sc.parallelize(range(2), 2).mapPartitionsWithIndex(task).collect()
    assert started.exists()
    assert progress.active_tasks(sc, group) == 0
