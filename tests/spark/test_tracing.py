"""A backfill run is one trace: every job it stages carries its run span's context.

``python -m drain.spark backfill`` in its own process (the SDK configured by the
standard OTEL_* variables, as a user runs it), exporting to a receiver on
127.0.0.1 (tests/otlp.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from pyspark.sql import SparkSession

from tests import roles, support
from tests.otlp import Receiver

pytestmark = pytest.mark.slow


def _backfill(db_url: str, path: str, run_id: str, env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "drain.spark", "backfill", "--source", f"parquet:{path}",
         "--task", "search.index_annotation", "--kwargs", "annotation_id=id",
         "--tag", "backfill.traced", "--id", run_id, "--partitions", "2"],
        env={**env, "DRAIN_SPARK_MASTER": "local[1]"}, capture_output=True, text=True,
        timeout=300, check=False, cwd=support.ROOT)
    assert done.returncode == 0, done.stderr


def test_each_backfill_run_is_one_trace(
    spark: SparkSession, db_url: str, tmp_path: Path,
) -> None:
    path = str(tmp_path / "records.parquet")
    spark.range(0, 30).write.parquet(path)
    # As the owner, as the docs run backfills (tests/roles.py).
    env = {k: v for k, v in support.drain_env(db_url, roles.ADMIN).items()
           if not k.startswith("OTEL_")}
    with Receiver() as receiver:
        _backfill(db_url, path, "traced-1", {**env, **receiver.env("backfill")})
        (span,) = receiver.wait_for(lambda spans: [
            s for s in spans if s.name == "backfill traced-1"] or None, what="the run's span")
        assert span.parent_span_id is None and span.service == "backfill"
        assert span.attributes["drain.backfill.id"] == "traced-1"
        with psycopg.connect(db_url) as conn:
            traces = [None if t is None else json.loads(t)["traceparent"] for (t,) in
                      conn.execute("SELECT trace::text FROM staged_jobs")]
        # All 30 jobs in the run's trace, children of its span.
        assert len(traces) == 30
        assert {t and t[:52] for t in traces} == {f"00-{span.trace_id}-{span.span_id}"}
