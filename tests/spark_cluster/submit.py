"""Submitting drain's Spark commands to the test cluster, and checking what they staged."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import psycopg

from drain.spark import mapping
from tests import support
from tests.spark import helpers
from tests.spark_cluster import standalone

TASK = "search.index_annotation"


def parquet(path: Path, n: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.mkdir(parents=True, exist_ok=True)
    ids = pa.array(range(n), pa.int64())
    pq.write_table(pa.table({"id": ids, "user_id": pa.compute.cast(
        pa.compute.divide(ids, 1000), pa.int32())}), path / "part-0.parquet")
    return str(path)


def submit(cluster: standalone.Cluster, bundle_dir: Path, db_url: str, log: Path,
            *args: str, conf: dict[str, str] | None = None) -> subprocess.Popen[str]:
    argv = cluster.submit_argv(bundle_dir, *args, "--database-url", db_url, "--json",
                               conf=conf)
    env = {**support.drain_env(db_url), **{k: v for k, v in cluster.env.items()
                                             if k.startswith("SPARK_")}}
    with log.open("wb") as err:  # the child has its own copy of the descriptor
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                cwd=bundle_dir.parent, start_new_session=True,
                                stdin=subprocess.DEVNULL)


def finish(proc: subprocess.Popen[str], log: Path, timeout: float = 300) -> dict[str, object]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    err = log.read_text(errors="replace")
    assert proc.returncode == 0, err[-4000:]
    assert "Traceback" not in err
    parsed: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return parsed


def committed(db_url: str, run_id: str) -> int:
    return len(helpers.ledger(db_url, run_id))


def assert_every_key_once(db_url: str, run_id: str, n: int, partitions: int) -> None:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT count(*), count(DISTINCT task_id), "
            "count(DISTINCT (kwargs->>'annotation_id')::bigint), "
            "min((kwargs->>'annotation_id')::bigint), max((kwargs->>'annotation_id')::bigint) "
            "FROM staged_jobs"
        ).fetchone()
        assert row == (n, n, n, 0, n - 1)
        # Every key's task id is the deterministic one (on a spread of keys).
        sample = conn.execute(
            "SELECT kwargs->>'annotation_id', task_id::text FROM staged_jobs "
            "WHERE (kwargs->>'annotation_id')::bigint % 997 = 0"
        ).fetchall()
    assert len(sample) == (n - 1) // 997 + 1
    assert all(str(mapping.task_id_for(run_id, key)) == task_id for key, task_id in sample)
    ledger = helpers.ledger(db_url, run_id)
    assert sorted(ledger) == list(range(partitions))
    assert sum(ledger.values()) == n
