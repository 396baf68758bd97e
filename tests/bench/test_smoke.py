"""Every benchmark's ``--smoke`` mode, so that a bench nobody runs does not rot.

Each runs as ``make bench-*`` runs it: ``python bench/bench_<name>.py --smoke``
as a script (bench/ on sys.path: the benches import each other), from the
repository's root, against the local Postgres and RabbitMQ. A smoke run uses
tiny sizes and asserts no figure; it must exit 0 and write
bench/results/<name>-smoke.json with a non-empty ``summary`` list.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
#: A smoke run takes seconds (Spark's: its JVM, ~15 s); this only stops a hung one.
TIMEOUT = 300.0


def _skip_without_spark() -> None:
    """Skip as tests/spark does: no pyspark, no Java, or no Postgres JDBC driver."""
    if importlib.util.find_spec("pyspark") is None:
        pytest.skip("pyspark is not installed: pip install -e '.[dev]'")
    if shutil.which("java") is None:
        pytest.skip("no Java runtime (java) on PATH: Spark needs Java 17+")
    from drain.spark import session

    jar = session.jdbc_jar()
    if jar is None or not jar.is_file():
        pytest.skip(
            f"Postgres JDBC driver missing ({session.DEBIAN_JDBC_JAR}): apt-get install "
            "libpostgresql-jdbc-java, or set DRAIN_SPARK_JDBC_JAR"
        )


BENCHES = [
    "throughput",
    "latency",
    "staging",
    pytest.param("mvcc", marks=pytest.mark.slow),  # tens of seconds
    "memory",
    pytest.param("lanes", marks=pytest.mark.slow),  # tens of seconds
    "priority",
    "crashes",
    "paused",
    "piles",
    pytest.param("curves", marks=pytest.mark.slow),  # seven curves: a minute
    pytest.param("spark", marks=[pytest.mark.spark, pytest.mark.slow]),  # a JVM of its own
]


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("name", BENCHES)
def test_bench_smoke(name: str) -> None:
    if name == "spark":
        _skip_without_spark()
    result_path = RESULTS / f"{name}-smoke.json"
    started = time.time()
    try:
        run = subprocess.run(
            [sys.executable, str(ROOT / "bench" / f"bench_{name}.py"), "--smoke"],
            cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT, check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"bench_{name}.py --smoke still ran after {TIMEOUT:.0f} s: {exc}")
    output = f"--- stdout ---\n{run.stdout[-3000:]}\n--- stderr ---\n{run.stderr[-3000:]}"
    assert run.returncode == 0, f"bench_{name}.py --smoke exited {run.returncode}\n{output}"
    assert result_path.is_file(), f"bench_{name}.py --smoke wrote no {result_path}\n{output}"
    # Written by this run, not left over from an earlier one (1 s: coarse file clocks).
    assert result_path.stat().st_mtime >= started - 1.0, f"{result_path} is stale"
    data = json.loads(result_path.read_text())
    summary = data.get("summary")
    assert isinstance(summary, list) and summary, f"no summary rows in {result_path}: {data}"
    assert all(isinstance(row, dict) and row.get("met") is None for row in summary), summary
